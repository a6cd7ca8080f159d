"""Decoding: colour modes and orientation of real photos come out right; bad bytes get codes."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from conftest import SAMPLES
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from redbatch.common.config import LimitSettings
from redbatch.common.protocol import ErrorCode
from redbatch.handlers.decode import (
    REFUSED_SIGNATURES,
    InputError,
    Signature,
    normalise_into,
    open_image,
    refused_format,
    resize_center_crop,
)
from redbatch.handlers.imagenet import EfficientNetLite0

LIMITS = LimitSettings()
CAT = (SAMPLES / "cat.jpg").read_bytes()


def photo() -> Image.Image:
    return Image.open(io.BytesIO(CAT)).convert("RGB")


def encode(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def mean_abs_diff(a: Image.Image, b: Image.Image) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).mean())


def test_plain_jpeg_decodes_to_rgb() -> None:
    img = open_image(CAT, LIMITS)
    assert img.mode == "RGB" and img.size == photo().size


@pytest.mark.parametrize("make, tolerance", [
    (lambda im: encode(im.convert("L"), "PNG"), 0.5),
    (lambda im: encode(im.convert("P", palette=Image.Palette.ADAPTIVE), "PNG"), 12.0),
    (lambda im: encode(im.convert("CMYK"), "JPEG", quality=95), 6.0),
    (lambda im: encode(im, "WEBP", quality=95), 6.0),
    (lambda im: encode(im, "BMP"), 0.01),
    (lambda im: encode(im, "TIFF"), 0.01),
])
def test_colour_modes_come_out_as_the_same_picture(make, tolerance: float) -> None:  # type: ignore[no-untyped-def]
    reference = photo()
    img = open_image(make(reference), LIMITS)
    assert img.mode == "RGB" and img.size == reference.size
    if tolerance == 0.5:  # grayscale: compare against the grayscale of the photo
        reference = reference.convert("L").convert("RGB")
    assert mean_abs_diff(img, reference) < tolerance


def test_alpha_is_flattened_onto_white() -> None:
    rgba = photo().convert("RGBA")
    alpha = Image.new("L", rgba.size, 255)
    alpha.paste(0, (0, 0, 50, 50))  # a fully transparent corner
    rgba.putalpha(alpha)
    img = open_image(encode(rgba, "PNG"), LIMITS)
    arr = np.asarray(img)
    assert img.mode == "RGB" and (arr[:50, :50] == 255).all()
    assert mean_abs_diff(img.crop((60, 60, 200, 200)), photo().crop((60, 60, 200, 200))) < 0.01


def test_16_bit_grayscale_is_scaled_not_clipped() -> None:
    gray8 = np.asarray(photo().convert("L"), dtype=np.uint16)
    gray16 = Image.fromarray(gray8 * 257)
    assert gray16.mode == "I;16"
    img = open_image(encode(gray16, "PNG"), LIMITS)
    assert img.mode == "RGB"
    assert np.abs(np.asarray(img)[..., 0].astype(int) - gray8.astype(int)).max() <= 1


def test_exif_rotation_is_applied() -> None:
    reference = photo()
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: the camera was turned; rotate 90 degrees clockwise to view
    stored = reference.transpose(Image.Transpose.ROTATE_90)  # what such a camera writes
    img = open_image(encode(stored, "JPEG", quality=95, exif=exif), LIMITS)
    assert img.size == reference.size
    assert mean_abs_diff(img, reference) < 6.0


def test_draft_mode_keeps_the_requested_minimum_side() -> None:
    big = photo().resize((1800, 1200), Image.Resampling.BICUBIC)
    img = open_image(encode(big, "JPEG", quality=90), LIMITS, min_side=256)
    assert min(img.size) >= 256 and img.size[0] < 1800
    assert resize_center_crop(img, 256, 224).size == (224, 224)


def _twelve_mp(img: Image.Image, fmt: str) -> bytes:
    """``img`` upscaled to 4000x3000; as an MPO, with a 1920x1440 preview as its second
    picture, the way many cameras write their JPEGs."""
    big = img.resize((4000, 3000), Image.Resampling.BICUBIC)
    if fmt == "MPO":
        return encode(big, "MPO", quality=90, save_all=True,
                      append_images=[big.resize((1920, 1440))])
    return encode(big, fmt, quality=90)


@pytest.mark.parametrize("size, fmt, decoded", [
    ((1024, 512), "JPEG", (512, 256)),  # exactly twice the target: half scale
    ((1022, 511), "JPEG", (1022, 511)),  # under twice: full size
    ((2048, 4096), "JPEG", (256, 512)),  # portrait, 8x: an eighth
    ((1024, 512), "PNG", (1024, 512)),  # only JPEG has a draft mode
])
def test_jpeg_draft_from_twice_the_target_side(size: tuple[int, int], fmt: str,
                                               decoded: tuple[int, int]) -> None:
    data = encode(photo().resize(size), fmt)
    assert open_image(data, LIMITS, min_side=256).size == decoded
    assert open_image(data, LIMITS).size == size


def test_a_cameras_multi_picture_jpeg_is_drafted_too() -> None:
    data = _twelve_mp(photo(), "MPO")
    assert Image.open(io.BytesIO(data)).format == "MPO"
    img = open_image(data, LIMITS, min_side=256)
    assert img.size == (500, 375) and img.mode == "RGB"


@pytest.fixture(scope="module")
def top1() -> Callable[[list[np.ndarray]], list[int]]:
    """The default model's top-1 class id for preprocessed inputs."""
    import torch
    from redbatch.handlers.efficientnet_lite import load_efficientnet_lite0

    model = load_efficientnet_lite0().eval()

    def classify(inputs: list[np.ndarray]) -> list[int]:
        with torch.inference_mode():
            return model(torch.from_numpy(np.stack(inputs))).argmax(1).tolist()

    return classify


@pytest.mark.full
def test_draft_keeps_the_top_class_of_every_sample_photo(
        top1: Callable[[list[np.ndarray]], list[int]]) -> None:
    # Each sample photo, and the same picture as a 12 MP JPEG and MPO: the default model's
    # preprocessing (with draft) against the same from a full-size decode.
    handler = EfficientNetLite0(LIMITS)
    samples = [Image.open(p).convert("RGB") for p in sorted(SAMPLES.glob("*.jpg"))]
    payloads = [p.read_bytes() for p in sorted(SAMPLES.glob("*.jpg"))]
    payloads += [_twelve_mp(img, fmt) for img in samples for fmt in ("JPEG", "MPO")]
    drafted, full = [], []
    for data in payloads:
        drafted.append(np.empty(handler.input_shape, np.float32))
        handler.preprocess(data, "", {}, drafted[-1])
        full.append(np.empty(handler.input_shape, np.float32))
        normalise_into(resize_center_crop(open_image(data, LIMITS), 256, 224), full[-1],
                       handler.mean, handler.std)
    assert len(payloads) == 9
    assert top1(drafted) == top1(full)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_header(width: int, height: int) -> bytes:
    """A tiny PNG file whose header declares width x height (a decompression bomb's shape)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr)
            + _chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + _chunk(b"IEND", b""))


@pytest.mark.parametrize("data, code", [
    (b"", ErrorCode.BAD_IMAGE),
    (b"hello, I am text", ErrorCode.BAD_IMAGE),
    (CAT[: len(CAT) // 2], ErrorCode.BAD_IMAGE),
    (CAT[:200], ErrorCode.BAD_IMAGE),
    (b"%PDF-1.7\n%binary", ErrorCode.UNSUPPORTED_FORMAT),
    (b"%!PS-Adobe-3.0 EPSF-3.0\n", ErrorCode.UNSUPPORTED_FORMAT),
    (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00", ErrorCode.UNSUPPORTED_FORMAT),
    (_png_header(100_000, 100_000), ErrorCode.IMAGE_TOO_LARGE),
    (_png_header(20_000, 10), ErrorCode.IMAGE_TOO_LARGE),
    (_png_header(0, 10), ErrorCode.BAD_IMAGE),
])
def test_bad_bytes_get_a_stable_code(data: bytes, code: ErrorCode) -> None:
    with pytest.raises(InputError) as info:
        open_image(data, LIMITS)
    assert info.value.code is code


def test_payload_over_the_limit_is_refused_before_decoding() -> None:
    with pytest.raises(InputError) as info:
        open_image(CAT, LimitSettings(max_payload_bytes=1000))
    assert info.value.code is ErrorCode.PAYLOAD_TOO_LARGE


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2048), st.integers(0, len(CAT)))
def test_fuzz_decoder_raises_only_input_errors(noise: bytes, cut: int) -> None:
    # Random bytes, and real JPEG bytes cut short and followed by noise.
    for data in (noise, CAT[:cut] + noise):
        try:
            open_image(data, LIMITS)
        except InputError:
            pass


# --------------------------------------------------------------------- recognised formats


def _saved(fmt: str, mode: str = "RGB") -> bytes:
    """The sample photo, small, written by Pillow in ``fmt``: a real file of that format."""
    return encode(photo().resize((64, 48)).convert(mode), fmt)


@pytest.mark.parametrize("fmt, mode, name", [
    ("PPM", "RGB", "PPM"), ("PPM", "L", "PGM"), ("PPM", "1", "PBM"), ("PDF", "RGB", "PDF"),
    ("EPS", "RGB", "PostScript/EPS"), ("ICO", "RGB", "ICO"), ("JPEG2000", "RGB", "JPEG 2000"),
    ("PCX", "RGB", "PCX"), ("SGI", "RGB", "SGI"), ("DDS", "RGB", "DDS"),
    ("TGA", "RGB", "CUR/TGA"),
])
def test_refused_formats_are_unsupported_not_bad(fmt: str, mode: str, name: str) -> None:
    with pytest.raises(InputError) as info:
        open_image(_saved(fmt, mode), LIMITS)
    assert info.value.code is ErrorCode.UNSUPPORTED_FORMAT
    assert info.value.message.startswith(f"{name} is not accepted; send one of JPEG, PNG")


@pytest.mark.parametrize("fmt, mode", [("MSP", "1"), ("XBM", "1"),
                                       ("SPIDER", "L"), ("DIB", "RGB")])
def test_formats_without_a_listed_signature_are_bad_images(fmt: str, mode: str) -> None:
    with pytest.raises(InputError) as info:
        open_image(_saved(fmt, mode), LIMITS)
    assert (info.value.code, info.value.message) == (ErrorCode.BAD_IMAGE,
                                                     "not a recognised image")


@pytest.mark.parametrize("sig", REFUSED_SIGNATURES, ids=lambda s: f"{s.name}@{s.offset}")
def test_each_listed_signature_is_unsupported_format(sig: Signature) -> None:
    data = b"\x00" * sig.offset + sig.magic + b"\x00" * 64
    assert refused_format(data) == sig.name
    with pytest.raises(InputError) as info:
        open_image(data, LIMITS)
    assert info.value.code is ErrorCode.UNSUPPORTED_FORMAT
    assert info.value.message.startswith(f"{sig.name} is not accepted")


def _tiff_with_compression(compression: int) -> bytes:
    """The sample photo as a TIFF whose first directory declares ``compression``."""
    data = bytearray(encode(photo().resize((32, 24)), "TIFF"))
    assert data[:4] == b"II*\x00"
    ifd = struct.unpack_from("<I", data, 4)[0]
    for i in range(struct.unpack_from("<H", data, ifd)[0]):
        entry = ifd + 2 + 12 * i
        if struct.unpack_from("<H", data, entry)[0] == 259:
            struct.pack_into("<H", data, entry + 8, compression)
            return bytes(data)
    raise AssertionError("no compression tag")


def test_a_tiff_with_a_compression_without_decoder_is_unsupported_format() -> None:
    for compression in (34712, 60000):  # JPEG 2000 in TIFF; a code nobody assigned
        with pytest.raises(InputError) as info:
            open_image(_tiff_with_compression(compression), LIMITS)
        assert info.value.code is ErrorCode.UNSUPPORTED_FORMAT
        assert info.value.message.startswith(f"TIFF compression {compression} cannot be")
    assert open_image(_tiff_with_compression(1), LIMITS).size == (32, 24)
    with pytest.raises(InputError) as info:
        open_image(b"II*\x00\xff\xff\xff\x7f", LIMITS)  # its directory is nowhere
    assert info.value.code is ErrorCode.BAD_IMAGE
