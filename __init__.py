"""redbatch: dynamic-batching inference over Redis streams.

The data path, top-down through the sub-packages::

    producer        -> submits jobs to a Redis stream, waits for results by request id
    gpu_worker      -> intake (XREADGROUP) -> batcher -> model -> result writer -> ack
    preproc_worker  -> process pool that decodes into shared-memory slots
    common          -> the wire protocol, settings, Redis helpers, CLI

See PROTOCOL.md for the wire format.
"""

__version__ = "0.1.0"
