"""The lock a model's first call at each batch size holds, process-wide.

NOTE [ First calls ]
  A model's first call at a batch size compiles it (torch.compile) or initialises lazily
  (autocast, oneDNN). Two CPU lanes doing that at once deadlocked inside torch (one leaving
  autocast, the other tracing in dynamo: issue 27) or compiled a size twice. So a first
  call, autocast and inference mode entered and left, holds this lock, one per process
  (dynamo's caches are process-wide); later calls at that size never take it.
"""

from __future__ import annotations

import threading

#: Held by a first call at a batch size (NOTE [ First calls ]); never on the steady path.
FIRST_CALLS = threading.Lock()
