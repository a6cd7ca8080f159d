"""Bytes to pixels, safely: format allowlist, size limits, orientation and colour modes.

Pure functions, no I/O besides the bytes given. Every failure is an
:class:`InputError` with a stable error code; nothing else escapes for bad input.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import (
    Image,
    ImageFile,
    ImageOps,
    JpegImagePlugin,
    TiffImagePlugin,
    UnidentifiedImageError,
)
from redbatch.common.config import LimitSettings
from redbatch.common.protocol import ErrorCode

#: Formats Pillow may open. Anything else (EPS runs Ghostscript, for one) is refused.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")


@dataclass(frozen=True, slots=True)
class Signature:
    """Bytes at a fixed offset that identify a format we recognise but do not accept."""

    name: str
    offset: int
    magic: bytes


#: The recognised formats besides ALLOWED_FORMATS: a payload that no accepted reader can
#: open and that carries one of these is ``unsupported_format``, anything else
#: ``bad_image``. Checked in this order (specific ISO brands before any ``ftyp``).
#: PROTOCOL.md lists the same rows; a test compares them.
REFUSED_SIGNATURES: tuple[Signature, ...] = (
    Signature("PDF", 0, b"%PDF"),
    Signature("PostScript/EPS", 0, b"%!PS"),
    Signature("EPS", 0, b"\xc5\xd0\xd3\xc6"),
    Signature("PSD", 0, b"8BPS"),
    Signature("ICO", 0, b"\x00\x00\x01\x00"),
    Signature("CUR/TGA", 0, b"\x00\x00\x02\x00"),  # an uncompressed true-colour TGA too
    Signature("ICNS", 0, b"icns"),
    Signature("JPEG 2000", 0, b"\x00\x00\x00\x0cjP  \r\n\x87\n"),
    Signature("JPEG 2000", 0, b"\xff\x4f\xff\x51"),
    Signature("JPEG XL", 0, b"\xff\x0a"),
    Signature("JPEG XL", 0, b"\x00\x00\x00\x0cJXL \r\n\x87\n"),
    Signature("QOI", 0, b"qoif"),
    Signature("DDS", 0, b"DDS "),
    Signature("PBM", 0, b"P1"),
    Signature("PGM", 0, b"P2"),
    Signature("PPM", 0, b"P3"),
    Signature("PBM", 0, b"P4"),
    Signature("PGM", 0, b"P5"),
    Signature("PPM", 0, b"P6"),
    Signature("PAM", 0, b"P7"),
    Signature("PFM", 0, b"PF\n"),
    Signature("PFM", 0, b"Pf\n"),
    Signature("SVG", 0, b"<svg"),
    Signature("XML (SVG)", 0, b"<?xml"),
    Signature("PCX", 0, b"\x0a\x05\x01"),
    Signature("SGI", 0, b"\x01\xda"),
    Signature("Sun raster", 0, b"\x59\xa6\x6a\x95"),
    Signature("OpenEXR", 0, b"v/1\x01"),
    Signature("Radiance HDR", 0, b"#?RADIANCE"),
    Signature("Radiance HDR", 0, b"#?RGBE"),
    Signature("FITS", 0, b"SIMPLE  ="),
    Signature("GIMP XCF", 0, b"gimp xcf"),
    Signature("XPM", 0, b"/* XPM */"),
    Signature("WMF", 0, b"\xd7\xcd\xc6\x9a"),
    Signature("EMF", 40, b" EMF"),
    Signature("BLP", 0, b"BLP1"),
    Signature("BLP", 0, b"BLP2"),
    Signature("DCX", 0, b"\xb1\x68\xde\x3a"),
    Signature("HEIC", 4, b"ftypheic"),
    Signature("HEIC", 4, b"ftypheix"),
    Signature("HEIF", 4, b"ftypmif1"),
    Signature("HEIF", 4, b"ftypmsf1"),
    Signature("AVIF", 4, b"ftypavif"),
    Signature("AVIF", 4, b"ftypavis"),
    Signature("ISO media (MP4, MOV, ...)", 4, b"ftyp"),
)
_TIFF_MAGIC = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")
_TIFF_COMPRESSION_TAG = 259

# Truncated files must fail, not decode half an image silently.
ImageFile.LOAD_TRUNCATED_IMAGES = False


class InputError(Exception):
    """A payload the model cannot use; carries the error code for the result."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def refused_format(data: bytes) -> str | None:
    """The name of the first REFUSED_SIGNATURES row ``data`` carries, else None."""
    for sig in REFUSED_SIGNATURES:
        if data.startswith(sig.magic, sig.offset):
            return sig.name
    return None


def _tiff_compression(data: bytes) -> int | None:
    """The compression a TIFF declares in its first directory, when Pillow has no decoder
    for it (why Pillow could not open it); None otherwise or when unreadable."""
    if not data.startswith(_TIFF_MAGIC):
        return None
    big = data[:4] in _TIFF_MAGIC[2:]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow warns about each corrupt entry
            ifd = TiffImagePlugin.ImageFileDirectory_v2(data[:16] if big else data[:8])
            fp = io.BytesIO(data)
            fp.seek(ifd.next)
            ifd.load(fp)
            compression = int(ifd.get(_TIFF_COMPRESSION_TAG, 1))
    except Exception:  # a corrupt directory can raise nearly anything: then it is bad_image
        return None
    return None if compression in TiffImagePlugin.COMPRESSION_INFO else compression


def _unidentified(data: bytes) -> InputError:
    """What to answer for bytes no accepted reader could open."""
    accepted = ", ".join(ALLOWED_FORMATS)
    name = refused_format(data)
    if name is not None:
        return InputError(ErrorCode.UNSUPPORTED_FORMAT,
                          f"{name} is not accepted; send one of {accepted}")
    compression = _tiff_compression(data)
    if compression is not None:
        return InputError(ErrorCode.UNSUPPORTED_FORMAT,
                          f"TIFF compression {compression} cannot be decoded; send a TIFF "
                          f"compressed otherwise, or one of {accepted}")
    return InputError(ErrorCode.BAD_IMAGE, "not a recognised image")


def _open(data: bytes, limits: LimitSettings) -> Image.Image:
    if not data:
        raise InputError(ErrorCode.BAD_IMAGE, "empty payload")
    if len(data) > limits.max_payload_bytes:
        raise InputError(ErrorCode.PAYLOAD_TOO_LARGE, f"{len(data)} bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise InputError(ErrorCode.IMAGE_TOO_LARGE, str(e)) from e
    except UnidentifiedImageError as e:
        raise _unidentified(data) from e
    except Exception as e:  # a corrupt header can raise nearly anything inside Pillow
        raise InputError(ErrorCode.BAD_IMAGE, f"unreadable image header: {e}") from e


def _check_size(img: Image.Image, limits: LimitSettings) -> None:
    width, height = img.size
    if width < 1 or height < 1:
        raise InputError(ErrorCode.BAD_IMAGE, f"image has no pixels ({width}x{height})")
    if max(width, height) > limits.max_image_side or width * height > limits.max_image_pixels:
        raise InputError(ErrorCode.IMAGE_TOO_LARGE,
                         f"{width}x{height} exceeds the limits of {limits.max_image_pixels} "
                         f"pixels and {limits.max_image_side} per side")


def open_image(data: bytes, limits: LimitSettings, min_side: int | None = None) -> Image.Image:
    """Decode ``data`` into an upright 8-bit RGB image.

    ``min_side`` is the caller's target: the side it scales the shorter side down to
    (every built-in handler passes it). A JPEG whose sides are both at least twice that
    long is then decoded at 1/2, 1/4 or 1/8 scale in the DCT (:func:`jpeg_draft`), so a 12 MP
    photo decodes about five times faster, with nearly the same pixels after the resize.
    The limits apply to the size the file declares, before any scaling.

    Raises InputError (bad_image, unsupported_format, image_too_large).
    """
    img = _open(data, limits)
    _check_size(img, limits)
    if min_side:
        jpeg_draft(img, min_side)
    try:
        img.load()
        ImageOps.exif_transpose(img, in_place=True)  # without a copy when upright
        return to_rgb(img)
    except InputError:
        raise
    except Exception as e:  # truncated data, bad EXIF, corrupt chunks...
        raise InputError(ErrorCode.BAD_IMAGE, f"cannot decode image: {e}") from e


def jpeg_draft(img: Image.Image, min_side: int) -> None:
    """Have a JPEG that is not yet loaded decode at 1/2, 1/4 or 1/8 scale (Pillow's draft
    mode: the DCT scales), the smallest of them that keeps both sides at least
    ``min_side``; nothing when its shorter side is under twice ``min_side``, nor for any
    other format.

    MPO files count as JPEG: a JPEG carrying more pictures (a preview, a second view), as
    many cameras write, which Pillow opens with the format name MPO.
    """
    if isinstance(img, JpegImagePlugin.JpegImageFile) and min(img.size) >= 2 * min_side:
        img.draft("RGB", (min_side, min_side))


def _flatten_alpha(img: Image.Image) -> Image.Image:
    # Transparent areas become white, as a browser would show them on a page.
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _high_bit_depth_to_rgb(img: Image.Image) -> Image.Image:
    # Modes I;16 and I hold 16-bit samples; Pillow's own convert("L") clips them.
    arr = np.asarray(img).astype(np.float32)
    scale = 255.0 / 65535.0 if arr.max(initial=0) > 255 else 1.0
    gray = np.clip(arr * scale, 0, 255).astype(np.uint8)
    return Image.fromarray(gray, mode="L").convert("RGB")


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode to 8-bit RGB: grayscale, palette, CMYK, alpha, 16-bit."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        return _flatten_alpha(img)
    if img.mode.startswith("I") or img.mode == "F":
        return _high_bit_depth_to_rgb(img)
    return img.convert("RGB")


def resize_center_crop(img: Image.Image, resize_to: int, crop: int) -> Image.Image:
    """Scale the shorter side to ``resize_to`` (bicubic), then cut the centre ``crop`` square.

    Only the source region under the crop is resampled (Pillow's ``box``), with the
    scale of the whole resize: the same pixels, in half the time for 256 -> 224.
    """
    width, height = img.size
    scale = resize_to / min(width, height)
    size = (max(crop, round(width * scale)), max(crop, round(height * scale)))
    sx, sy = size[0] / width, size[1] / height
    left = (size[0] - crop) // 2
    top = (size[1] - crop) // 2
    box = (left / sx, top / sy, (left + crop) / sx, (top + crop) / sy)
    return img.resize((crop, crop), Image.Resampling.BICUBIC, box=box, reducing_gap=3.0)


def normalise_into(img: Image.Image, out: np.ndarray, mean: float | np.ndarray,
                   std: float | np.ndarray) -> None:
    """Write ``(pixels - mean) / std`` as CHW float32 into ``out`` (a shared-memory slot)."""
    hwc = np.asarray(img, dtype=np.uint8)
    chw = hwc.transpose(2, 0, 1)
    np.subtract(chw, np.reshape(mean, (-1, 1, 1)), out=out, dtype=np.float32, casting="unsafe")
    np.divide(out, np.reshape(std, (-1, 1, 1)), out=out, casting="unsafe")
