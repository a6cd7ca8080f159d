"""What calibration measures on a device: the variants worth trying there (channels_last,
autocast, torch.compile), and what identifies the device and the model a profile was
measured on (device_info, fingerprint)."""

from __future__ import annotations

import hashlib
import platform
import shutil
from collections.abc import Callable

import torch
from redbatch.gpu_worker.tuning.profile import DeviceInfo, Variant
from redbatch.handlers.base import Handler

Model = Callable[[torch.Tensor], torch.Tensor]


def cxx_compiler_found() -> bool:
    """Whether inductor can build CPU kernels here (it needs a C++ compiler)."""
    return any(shutil.which(cc) for cc in ("c++", "g++", "clang++"))


def compile_by_default(device: torch.device) -> bool:
    """Whether calibration tries torch.compile unless told: on CPU, where inductor's
    frozen graphs are much faster (EfficientNet-Lite0: about 1.45x channels_last), when
    it can build them."""
    return device.type == "cpu" and cxx_compiler_found()


def candidate_variants(device: torch.device, try_compile: bool | None) -> list[Variant]:
    """Variants worth trying on this device; the plain one first (it wins ties)."""
    if try_compile is None:
        try_compile = compile_by_default(device)
    found = [Variant(), Variant(channels_last=True)]
    if device.type == "cuda":
        dtypes = ["float16"] + (["bfloat16"] if torch.cuda.is_bf16_supported() else [])
        found += [Variant(cl, dt) for dt in dtypes for cl in (False, True)]
    elif cpu_has_native_bf16():
        found.append(Variant(channels_last=True, autocast="bfloat16"))
    if try_compile:
        found += [Variant(v.channels_last, v.autocast, compile=True) for v in found[1:]]
    return found


def cpu_has_native_bf16() -> bool:
    """Whether the CPU computes in bfloat16 itself (AVX512-BF16, AMX): there bf16
    autocast runs EfficientNet-Lite0 about twice as fast. Elsewhere oneDNN emulates it,
    slower than float32, so it is not worth measuring."""
    return bool(set(_cpuinfo("flags").split()) & {"avx512_bf16", "amx_bf16"})


def _cpuinfo(field: str) -> str:
    """The value of the first ``field`` line of /proc/cpuinfo; '' where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def parse_variant(name: str) -> Variant:
    """'eager', 'channels_last', 'fp16', 'channels_last+bf16+compile', ...; ValueError else."""
    parts = set(name.split("+")) - {"eager"}
    unknown = parts - {"channels_last", "fp16", "bf16", "compile"}
    if unknown or {"fp16", "bf16"} <= parts:
        raise ValueError(f"unknown variant {name!r}: combine channels_last, fp16 or bf16, "
                         "compile with '+', or say eager")
    autocast = "float16" if "fp16" in parts else "bfloat16" if "bf16" in parts else None
    return Variant("channels_last" in parts, autocast, "compile" in parts)


def device_info(device: torch.device, lanes: int = 1) -> DeviceInfo:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceInfo("cuda", props.name, torch.get_num_threads(), int(props.total_memory))
    return DeviceInfo("cpu", cpu_name(), torch.get_num_threads(), lanes=lanes)


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "cpu"


def fingerprint(handler: Handler, model: Model) -> str:
    """A hash of the handler's class, the input shape and (for modules) every tensor of the
    state dict: names, dtypes, shapes and values. Another checkpoint, another fingerprint."""
    h = hashlib.sha256()
    h.update(f"{type(handler).__qualname__}|{handler.input_shape}|{handler.input_dtype}|"
             f"{type(model).__qualname__}".encode())
    if isinstance(model, torch.nn.Module):
        for name, tensor in model.state_dict().items():
            flat = tensor.detach().cpu().contiguous().reshape(-1)
            h.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}".encode())
            h.update(flat.view(torch.uint8).numpy())
    return "sha256:" + h.hexdigest()[:32]
