"""redbatch: dynamic-batching inference over Redis streams.

The sub-packages, in data-path order (imports only run down this list, never up it;
tests/test_layout.py checks it)::

    cli             the `redbatch` command: the top floor, imports every package below
    producer        submits jobs to a model's Redis stream, waits for results by request id
    gpu_worker      intake (XREADGROUP) -> batcher -> model -> result writer -> ack
    preproc_worker  process pool that decodes payloads into shared-memory slots
    handlers        what a model provides (preprocess, load, postprocess): the neutral
                    floor the pool and the worker share
    common          only what every side needs: the wire protocol, settings, the Redis
                    connection factory, logging

See PROTOCOL.md for the wire format.
"""

__version__ = "0.1.0"
