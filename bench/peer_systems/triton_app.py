"""Server process of the PyTriton peer: Triton's dynamic batcher in front of the model.

    <side-env python> bench/peer_systems/triton_app.py --http-port P --grpc-port G \
        --metrics-port M [--max-batch-size 16] [--delay-us 5000]

Model "classify": input "image" (the photo's bytes, BYTES, shape [1]), output "result" (the
top-5 as JSON, BYTES, shape [1]). Triton batches requests (max batch, queue delay) and the
bound Python function decodes and runs each batch. Stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

from peer_systems.model import Classifier

MODEL = "classify"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for port in ("--http-port", "--grpc-port", "--metrics-port"):
        parser.add_argument(port, type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--delay-us", type=int, default=5000)
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    model = Classifier()

    @batch
    def infer(image: np.ndarray) -> dict[str, np.ndarray]:
        results = model.classify([bytes(row[0]) for row in image])
        return {"result": np.array([[json.dumps(r).encode()] for r in results], dtype=object)}

    config = TritonConfig(http_address="127.0.0.1", http_port=args.http_port,
                          grpc_address="127.0.0.1", grpc_port=args.grpc_port,
                          metrics_address="127.0.0.1", metrics_port=args.metrics_port)
    with Triton(config=config) as triton:
        triton.bind(model_name=MODEL, infer_func=infer,
                    inputs=[Tensor(name="image", dtype=np.bytes_, shape=(1,))],
                    outputs=[Tensor(name="result", dtype=np.bytes_, shape=(1,))],
                    config=ModelConfig(max_batch_size=args.max_batch_size,
                                       batcher=DynamicBatcher(
                                           max_queue_delay_microseconds=args.delay_us)),
                    strict=False)
        triton.run()
        print("READY", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
