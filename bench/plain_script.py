"""The baseline a user would write first: decode with Pillow, run the eager model in batches.

    .venv/bin/python bench/plain_script.py [--images 320] [--batch-size 16]

Nothing tuned on purpose: torch's default threads, glibc's default malloc (bench/throughput.py
runs it in a subprocess without the worker's MALLOC_* variables), a full decode of every photo
(no JPEG draft mode), float32 NCHW, ``torch.no_grad``. The network and weights are the ones
redbatch serves (EfficientNet-Lite0; its definition is all this script takes from redbatch),
with the same preprocessing: bicubic resize of the shorter side to 256, centre crop 224,
(x - 127) / 128.

Prints one JSON line last: {"images", "batch_size", "seconds", "images_per_s", "threads"}.
"""

from __future__ import annotations

import argparse
import json
import time
from io import BytesIO
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from redbatch.handlers.efficientnet_lite import load_efficientnet_lite0

ROOT = Path(__file__).resolve().parent.parent


def preprocess(data: bytes) -> np.ndarray:
    img = Image.open(BytesIO(data)).convert("RGB")
    w, h = img.size
    scale = 256 / min(w, h)
    img = img.resize((round(w * scale), round(h * scale)), Image.Resampling.BICUBIC)
    left, top = (img.width - 224) // 2, (img.height - 224) // 2
    img = img.crop((left, top, left + 224, top + 224))
    return ((np.asarray(img, dtype=np.float32) - 127.0) / 128.0).transpose(2, 0, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=320)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    photos = [p.read_bytes() for p in sorted((ROOT / "samples").glob("*.jpg"))]
    payloads = [photos[i % len(photos)] for i in range(args.images)]
    model = load_efficientnet_lite0()
    with torch.no_grad():
        model(torch.zeros(args.batch_size, 3, 224, 224))  # warm-up, as the others get
        start = time.perf_counter()
        for i in range(0, len(payloads), args.batch_size):
            batch = np.stack([preprocess(p) for p in payloads[i:i + args.batch_size]])
            model(torch.from_numpy(batch)).softmax(dim=1).topk(5, dim=1)
        seconds = time.perf_counter() - start
    print(json.dumps({"images": args.images, "batch_size": args.batch_size,
                      "seconds": round(seconds, 3),
                      "images_per_s": round(args.images / seconds, 2),
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
