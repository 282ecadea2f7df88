"""Device -> Target at run time, the token-count buckets GEMM kernels are specialised for, and the dtype table of
kernel signatures. Launching lives in k3c.runtime.launcher (the one launcher); the torch-facing family wrappers
(rmsnorm, gemm, ...) in k3c.runtime.kernel_impls.basic."""
from __future__ import annotations

import functools

import torch

from .kernels.common import pow2_ceil
from .targets import TARGETS, Target, get_target
from .writer import CodegenError

TORCH_TO_TT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
               torch.int32: "i32", torch.uint8: "u8"}


def tt_dtype(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_TT[dtype]
    except KeyError:
        raise CodegenError(f"no kernel dtype for {dtype}") from None


# -- targets -------------------------------------------------------------------------------------------------------
# Overrides: a runtime session running an artifact binds the device to the artifact's Target (an h100 artifact on an
# H200 keeps the h100 row), so the kernels it picks at run time carry the artifact's catalogue keys.
_BOUND: dict[tuple[str, int], Target] = {}


def _device_key(device: torch.device | str) -> tuple[str, int]:
    d = torch.device(device)
    return d.type, d.index if d.index is not None else (torch.cuda.current_device() if d.type == "cuda" else 0)


@functools.lru_cache(maxsize=None)
def _detected_target(device_type: str, index: int) -> Target:
    """The Target of the device itself (targets.target_for_properties on torch's device properties)."""
    from .targets import target_for_properties

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


def _device_target(device_type: str, index: int) -> Target:
    bound = _BOUND.get((device_type, index))
    return bound if bound is not None else _detected_target(device_type, index)


def bind_device_target(device: torch.device | str, target: Target | str) -> Target | None:
    """From now on `target_for(device)` (and every kernel wrapper running on it) answers `target` instead of the
    device's own row; returns the Target bound before, if any. A GPU device takes a GPU target (whether its arch
    matches the device is the caller's check: the artifact loader's); a cpu or meta device takes any target (a CPU
    run or a meta-tensor recording of another target's kernel choices)."""
    tgt = get_target(target) if isinstance(target, str) else target
    if not isinstance(tgt, Target):
        raise CodegenError(f"bind_device_target: expected a Target or a target name, got {target!r}")
    key = _device_key(device)
    if key[0] == "cuda" and tgt.backend == "cpu":
        raise CodegenError(f"cannot bind target '{tgt.name}' ({tgt.backend}) to device {key[0]}:{key[1]}")
    prev = _BOUND.get(key)
    _BOUND[key] = tgt
    return prev


def unbind_device_target(device: torch.device | str) -> Target | None:
    """Drop `device`'s override (target_for answers the device's own row again); returns what was bound, or None."""
    return _BOUND.pop(_device_key(device), None)


def device_target(device: torch.device | str) -> Target:
    """The device's own Target (targets.target_for_properties), whatever is bound to it."""
    return _detected_target(*_device_key(device))


def target_for(device: torch.device | str) -> Target:
    """The Target describing `device`: the one bound to it (bind_device_target), else cpu -> the interpreter
    target; cuda -> targets.target_for_properties of the device (an H200 -> h200, an H100 -> h100)."""
    return _device_target(*_device_key(device))


M_BUCKET_MAX = 1024
M_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)    # every m_hint the GEMM wrappers can ask for (AOT: emit these)


def m_bucket(m: int) -> int:
    """The token-count bucket the GEMM tiles are specialised for: powers of two from 16 to 1024 (every M >= 513
    shares the 1024 kernel; tiles only change below that, and the program-count rule needs M's scale)."""
    return max(16, min(M_BUCKET_MAX, pow2_ceil(max(1, m))))



__all__ = ["target_for", "device_target", "tt_dtype", "TORCH_TO_TT", "m_bucket", "M_BUCKETS"]
