"""The torch side of kernels: which Target a device is (detected from its properties; whether a tensor's kernels
run in the interpreter), and the one dtype table (user spellings -> torch
dtypes, torch dtypes -> kernel signature types)."""
from __future__ import annotations

import functools

import torch

from ..codegen.targets import TARGETS, Target
from ..codegen.writer import CodegenError
from ..errors import ArgumentError
from ..ir.core import DTYPE_SPELLINGS

TORCH_TO_TT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
               torch.int32: "i32", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}
TT_TO_TORCH = {name: dt for dt, name in TORCH_TO_TT.items()}      # a kernel signature type's torch dtype

# The torch dtype of each IR float type a model runs in, and of every spelling of it k3c accepts.
TORCH_OF_IR = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
TORCH_DTYPES = {spelling: TORCH_OF_IR[ir] for spelling, ir in DTYPE_SPELLINGS.items()}


def tt_dtype(dtype: torch.dtype) -> str:
    """The kernel signature type of a torch dtype ("bf16", "fp32", ...)."""
    try:
        return TORCH_TO_TT[dtype]
    except KeyError:
        raise CodegenError(f"no kernel dtype for {dtype}") from None


def torch_dtype(name: str, what: str = "dtype") -> torch.dtype:
    """The torch dtype a user, config or checkpoint names (`what` names the argument in the error)."""
    try:
        return TORCH_DTYPES[name]
    except (KeyError, TypeError):
        raise ArgumentError(f"{what} {name!r}: choose from {', '.join(sorted(TORCH_DTYPES))}") from None


# -- targets --------------------------------------------------------------------------------------------------------
# Only the device's own row is answered here: which Target a model's kernels are planned for at run time is its
# Binding's (launcher.Binding, owned by the session or engine that loaded it).
def _device_key(device: torch.device | str) -> tuple[str, int]:
    d = torch.device(device)
    return d.type, d.index if d.index is not None else (torch.cuda.current_device() if d.type == "cuda" else 0)


@functools.lru_cache(maxsize=None)
def _detected_target(device_type: str, index: int) -> Target:
    """The Target of the device itself (targets.target_for_properties on torch's device properties)."""
    from ..codegen.targets import target_for_properties

    if device_type == "cpu":
        return TARGETS["cpu"]
    if device_type != "cuda":
        raise CodegenError(f"no kernel target for device type {device_type!r}")
    props = torch.cuda.get_device_properties(index)
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    if getattr(torch.version, "hip", None):
        backend, arch = "hip", str(getattr(props, "gcnArchName", ""))
    else:
        backend, arch = "cuda", f"sm_{props.major}{props.minor}"
    return target_for_properties(backend, arch, str(getattr(props, "name", "") or ""),
                                 int(getattr(props, "total_memory", 0) or 0), smem)


def target_for(device: torch.device | str) -> Target:
    """The device's own Target: cpu -> the interpreter target; cuda -> targets.target_for_properties of the device
    (an H200 -> h200, an H100 -> h100). A model bound to an artifact plans with its Binding's target instead
    (launcher.target_of)."""
    return _detected_target(*_device_key(device))


def interpreted(t: torch.Tensor) -> bool:
    """Whether kernels on `t` run through the Triton interpreter (a CPU tensor): such a launch takes the
    interpreter variant of its kernel, whatever target its binding plans for."""
    return t.device.type == "cpu"


def host_to_device(device: torch.device):
    """A function putting a host tensor on `device` without a device sync (pinned staging, non-blocking copy; the
    caching host allocator keeps the staging block until the copy has run)."""
    if device.type != "cuda":
        return lambda t: t.to(device)
    return lambda t: t.pin_memory().to(device, non_blocking=True)
