"""Real inputs for checking a model variant's answers: the sample photos and crops of them.

Calibration compares each faster variant (reduced precision, compiled) with the plain model
on inputs like the ones it will serve, not on random tensors: a variant whose outputs are
a few per cent away from float32's on noise can still change the top class of real photos
(bf16 autocast on this repository's CPU did for 4% of crops). The sample photos alone are
three; the crops make the set varied enough that 99.5% agreement means something: each is
a random part of a photo (8-100% of its area, aspect 3:4 to 4:3, as in training-time
augmentation), mirrored half the time, with its brightness and colour changed by up to
20%, re-encoded as JPEG. Deterministic for a given seed and count, so that two
calibrations judge on the same inputs.

Imported by the worker (calibration) only; Pillow only, no torch.
"""

from __future__ import annotations

import io
import random
from functools import cache
from importlib import resources

from PIL import Image, ImageEnhance, ImageOps

#: Folder of the sample photos inside the package (``samples/`` in a checkout).
SAMPLES_FOLDER = "samples"
#: Smallest share of a photo's area a crop keeps, and the widest aspect ratio either way.
MIN_AREA, MAX_ASPECT = 0.08, 4 / 3
#: Largest change of brightness and of colour saturation, either way.
JITTER = 0.2
JPEG_QUALITY = 90


@cache
def sample_photos() -> tuple[bytes, ...]:
    """The JPEG bytes of the sample photos shipped with the package, by name."""
    folder = resources.files("redbatch").joinpath(SAMPLES_FOLDER)
    return tuple(entry.read_bytes() for entry in sorted(folder.iterdir(), key=lambda e: e.name)
                 if entry.name.endswith(".jpg"))


def augmented_photos(n: int, seed: int = 0) -> list[bytes]:
    """``n`` JPEGs: the sample photos themselves first, then crops of them (module
    docstring), the same ``n`` bytes strings for the same ``n`` and ``seed``."""
    photos = sample_photos()
    if not photos:
        raise FileNotFoundError(f"no sample photos in the package's {SAMPLES_FOLDER}/")
    rng = random.Random(seed)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in photos]
    out = list(photos[:n])
    while len(out) < n:
        out.append(_encode(_augment(images[len(out) % len(images)], rng)))
    return out


def _augment(img: Image.Image, rng: random.Random) -> Image.Image:
    """A random crop of ``img``, maybe mirrored, its brightness and colour jittered."""
    width, height = img.size
    area = width * height * rng.uniform(MIN_AREA, 1.0)
    aspect = rng.uniform(1 / MAX_ASPECT, MAX_ASPECT)
    w = min(width, max(16, round((area * aspect) ** 0.5)))
    h = min(height, max(16, round((area / aspect) ** 0.5)))
    x, y = rng.randint(0, width - w), rng.randint(0, height - h)
    crop = img.crop((x, y, x + w, y + h))
    if rng.random() < 0.5:
        crop = ImageOps.mirror(crop)
    crop = ImageEnhance.Brightness(crop).enhance(rng.uniform(1 - JITTER, 1 + JITTER))
    return ImageEnhance.Color(crop).enhance(rng.uniform(1 - JITTER, 1 + JITTER))


def _encode(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()
