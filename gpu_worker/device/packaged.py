"""Compiled models that load in seconds: AOTInductor packages, built once, kept beside the
calibration profile.

NOTE [ Compiled packages ]
  ``torch.compile`` compiles a graph per batch size at every start, in the worker: about
  10 s per size for EfficientNet-Lite0 on this CPU, so a worker with a compiled profile
  took 60-78 s to become ready, and the next start paid it all again. Inductor's own cache
  cannot keep these graphs: with frozen weights on CPU they hold prepacked mkldnn weights,
  which it refuses to pickle ("mkldnn tensors unpickleable"); turning prepacking off lets
  the cache hit but leaves tracing (several seconds a size) and runs a third slower.

  Instead a worker serving a compiled variant in full precision exports the model once
  with a dynamic batch dimension (``torch.export``, 1..max batch) and compiles it ahead of
  time into one package (``aoti_compile_and_package``, weights frozen as with
  torch.compile): one graph for every batch size, so batches are not padded to compiled
  sizes either. The package is written beside the profile, named by a hash of what it
  depends on (the model's fingerprint, the variant, the max batch, the torch version and
  the device), and loaded by every later start in about 2 s.

  The package's own loader (``load_package``) holds the GIL for the whole forward pass on
  CPU: a pure-Python thread ran at 10% of its speed beside it (92% beside torch.compile),
  and the worker's intake, pump and writer starved (60-78 against 150 img/s). So the
  worker keeps only the package's compiled library (``*.wrapper.so``, the weights inside)
  and calls its C interface (``AOTInductorModelContainerRun``) through ctypes, which
  releases the GIL during the call (98% of the Python thread's speed), with one model per
  CPU lane in the container so lanes run at once. Tensors cross by the handles torch's
  own AOTI bindings make (``torch._C._aoti``). A library that does not load (another
  torch, a damaged file) is built again. CPU only: on CUDA the container would need the
  lane's stream, and compile is not tried there by default. Autocast variants keep
  ``torch.compile``: export does not carry autocast into the package.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from redbatch.gpu_worker.tuning.profile import Variant

logger = logging.getLogger(__name__)

#: What a package holds: a callable from a batch tensor to the output tensor.
Compiled = Callable[[torch.Tensor], torch.Tensor]


def packaged(variant: Variant, device: torch.device) -> bool:
    """Whether ``variant`` is served from a package: compiled, in full precision, on CPU,
    with a torch that makes AOTInductor packages (2.6 and later)."""
    return variant.compile and not variant.pads_batches(device.type) and \
        hasattr(torch._inductor, "aoti_compile_and_package")


def package_path(profile_file: Path, fingerprint: str, variant: Variant, max_batch: int,
                 device: torch.device) -> Path:
    """``<profile stem>--<variant>--<hash>.so`` beside the profile; the hash covers
    everything the library depends on, so a change makes a new one."""
    what = f"{fingerprint} {variant.name} {max_batch} {torch.__version__} {device.type}"
    tag = hashlib.sha256(what.encode()).hexdigest()[:16]
    return profile_file.with_name(f"{profile_file.stem}--{variant.name}--{tag}.so")


def package_or_none(model: Compiled, variant: Variant, input_shape: tuple[int, ...],
                    input_dtype: str, max_batch: int, device: torch.device, path: Path,
                    runners: int) -> tuple[Compiled | None, str]:
    """:func:`load_or_build`, or None when the model cannot be packaged (export refuses
    data-dependent control flow that ``torch.compile`` handles with graph breaks, or
    there is no C++ compiler): the worker then compiles it as before, and the note says
    why. A model that cannot be packaged never stops a worker from starting."""
    try:
        return load_or_build(model, variant, input_shape, input_dtype, max_batch, device,
                             path, runners)
    except Exception as e:  # noqa: BLE001 - any failure falls back to torch.compile
        return None, (f"no compiled package ({type(e).__name__}: {str(e)[:200]}); "
                      "torch.compile compiles each batch size at start instead")


def load_or_build(model: Compiled, variant: Variant, input_shape: tuple[int, ...],
                  input_dtype: str, max_batch: int, device: torch.device, path: Path,
                  runners: int) -> tuple[Compiled, str]:
    """The package at ``path`` loaded (built and written first when it is missing or does
    not load), and a line for the start-up log saying which and how long it took."""
    start = time.perf_counter()
    if path.exists():
        try:
            loaded = _Container(path, runners)
            return loaded, (f"loaded compiled package {path} in "
                            f"{time.perf_counter() - start:.1f} s")
        except Exception as e:  # noqa: BLE001 - any unusable package is built again
            logger.warning("compiled package %s does not load (%s: %s); building it again",
                           path, type(e).__name__, str(e)[:200])
    _build(model, variant, input_shape, input_dtype, max_batch, device, path)
    built_s = time.perf_counter() - start
    loaded = _Container(path, runners)
    return loaded, (f"built compiled package {path} in {built_s:.1f} s (batch 1-{max_batch}; "
                    "later starts load it)")


def _build(model: Compiled, variant: Variant, input_shape: tuple[int, ...], input_dtype: str,
           max_batch: int, device: torch.device, path: Path) -> None:
    """Export ``model`` with a dynamic batch dimension and compile it into ``path``
    (written whole or not at all)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"only a torch.nn.Module can be packaged, not {type(model).__name__}")
    fmt = torch.channels_last if variant.channels_last else torch.contiguous_format
    module: torch.nn.Module = model.eval().to(memory_format=fmt)  # type: ignore[call-overload]
    # Export specializes a dimension of size 1: the example batch is 2 (when allowed).
    example = torch.zeros((min(2, max_batch), *input_shape), dtype=getattr(torch, input_dtype),
                          device=device)
    if example.dim() == 4:
        example = example.contiguous(memory_format=fmt)
    dynamic = ({0: torch.export.Dim("batch", min=1, max=max_batch)},) if max_batch > 1 \
        else None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with torch.inference_mode(), tempfile.TemporaryDirectory() as scratch:
            exported = torch.export.export(module, (example,), dynamic_shapes=dynamic)
            package = Path(scratch) / "model.pt2"
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(package), inductor_configs={"freezing": True})
            with zipfile.ZipFile(package) as archive:
                [member] = [n for n in archive.namelist() if n.endswith(".wrapper.so")]
                tmp.write_bytes(archive.read(member))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class _Container:
    """The C interface of an AOTInductor library (torch/csrc/inductor/aoti_runtime/
    interface.h), called through ctypes: ctypes releases the GIL during each call."""

    _H = ctypes.c_void_p

    def __init__(self, path: Path, models: int) -> None:
        h, size = self._H, ctypes.c_size_t
        self._lib = lib = ctypes.CDLL(str(path))
        lib.AOTInductorModelContainerCreateWithDevice.argtypes = [
            ctypes.POINTER(h), size, ctypes.c_char_p, ctypes.c_char_p]
        lib.AOTInductorModelContainerRun.argtypes = [
            h, ctypes.POINTER(h), size, ctypes.POINTER(h), size, h, h]
        lib.AOTInductorModelContainerGetNumOutputs.argtypes = [h, ctypes.POINTER(size)]
        lib.AOTInductorModelContainerDelete.argtypes = [h]
        self._handle = h()
        self._check(lib.AOTInductorModelContainerCreateWithDevice(
            ctypes.byref(self._handle), max(1, models), b"cpu", None), "create")
        outputs = size()
        self._check(lib.AOTInductorModelContainerGetNumOutputs(
            self._handle, ctypes.byref(outputs)), "count outputs")
        if outputs.value != 1:
            raise RuntimeError(f"{path}: {outputs.value} outputs, not one tensor")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The model on ``x``; the library takes the input handle, and the output's is
        handed back as a tensor."""
        inputs = (self._H * 1)(*[_pointer(c) for c in
                                  torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors([x])])
        output = (self._H * 1)()
        self._check(self._lib.AOTInductorModelContainerRun(
            self._handle, inputs, 1, output, 1, None, None), "run")
        steal: Any = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs
        tensor: torch.Tensor = steal([_capsule(output[0])])[0]
        return tensor

    def __del__(self) -> None:
        if getattr(self, "_handle", None):
            self._lib.AOTInductorModelContainerDelete(self._handle)

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:  # the library printed the C++ exception on stderr
            raise RuntimeError(f"compiled model: {what} failed (AOTInductor error {code})")


_api: Any = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _pointer(capsule: object) -> int:
    """The tensor handle in a capsule of torch's AOTI bindings."""
    return int(_api.PyCapsule_GetPointer(capsule, None))


def _capsule(pointer: int | None) -> object:
    """A tensor handle in a capsule, as torch's AOTI bindings take it."""
    return _api.PyCapsule_New(pointer, None, None)

