"""Which model's batch runs next, when one worker serves several (``--model A --model B``).

Each model keeps its own batcher, lanes and in-flight places; they share the device, which
runs as many batches at once as the runner's depth allows. When the device has room, the
main loop offers it to the models in the order :meth:`ModelTurns.order` gives, and the first
with a batch due runs it. A pure policy: the loop tells it what was launched and how long
each batch ran; it never sees a job, a clock or a thread.

NOTE [ Fair turns between models ]
  Fair in device time, not in batches: a text batch may run ten times as long as an image
  batch, and alternating batches would give the text model ten times the device.
  So the next turn goes to the model with work due that has used the least device time;
  between models that used the same, to the one launched longest ago, so that equal
  models alternate batch by batch (and a model whose batch is still running does not
  go again before the other had its turn).
  An idle model does not bank credit: after each batch, every model's use is raised to at
  least the busiest one's less CREDIT_S. A model coming back from idle then runs at most
  CREDIT_S of device time ahead of the others before they alternate again, instead of
  owning the device for as long as it was idle.
"""

from __future__ import annotations

#: Device time, seconds, a model coming back from idle may run ahead of the others.
CREDIT_S = 0.05


class ModelTurns:
    """The turns of ``n`` models on one device (NOTE [ Fair turns between models ])."""

    def __init__(self, n: int, credit_s: float = CREDIT_S) -> None:
        if n < 1:
            raise ValueError("at least one model")
        self.credit_s = credit_s
        #: Device seconds each model's batches have run, raised as the NOTE says.
        self.used_s = [0.0] * n
        self._last_launch = [0] * n  # the launch count when each model last launched
        self._launches = 0

    def order(self) -> list[int]:
        """The models, the one owed the device first."""
        used, last = self.used_s, self._last_launch
        return sorted(range(len(used)), key=lambda i: (used[i], last[i]))

    def launched(self, model: int) -> None:
        """A batch of ``model`` went to the device."""
        self._launches += 1
        self._last_launch[model] = self._launches

    def ran(self, model: int, seconds: float) -> None:
        """A batch of ``model`` ran for ``seconds`` on the device."""
        used = self.used_s
        used[model] += max(0.0, seconds)
        floor = max(used) - self.credit_s
        for i, u in enumerate(used):
            if u < floor:
                used[i] = floor
