"""Load and launch one ahead-of-time compiled kernel binary (cubin / hsaco) through the vendor driver API, via ctypes.

    ck = load_manifest(out_dir)[0]                       # k3c.codegen.aot
    k = load_compiled(ck, out_dir)                       # or load_binary(image, backend=..., entry_name=..., ...)
    k.launch((cdiv(M, 64), 1, 1), [x, w, out, M])        # runtime args in signature order, on torch's current stream

One code path for both vendors: a small table of driver entry points (CUDA driver API in libcuda.so.1, HIP module API
in libamdhip64.so) behind `_Driver`; everything else (argument marshalling, checks, scratch) is shared.

The launch conventions are those of the triton (3.9) that compiles the binaries, read from its own launcher
(triton/backends/nvidia/driver.c: launchKernel, _launch, extraction_map, loadBinary; triton/backends/amd/driver.c:
the same names; driver.py: CudaLauncher/HIPLauncher.__call__):
  * kernel params: the non-constexpr args in signature order (constexprs are not params; ASTSource compiles with the
    signature as given, so no other arg is dropped: the JIT's specialisation of ints equal to 1 / None args does not
    apply to AOT), then the global-scratch pointer, then the profile-scratch pointer. Both trailing pointers are
    always passed: every entry triton 3.6 and 3.9 emit has both (PTX and AMDGCN alike, even where the metadata lacks
    a `*_scratch_size` key: triton 3.6's hip metadata), and a driver reads only as many params as the entry has, so
    an older binary with fewer is launched correctly too; a missing size key means size 0;
  * each param is passed by address: pointers as 64-bit device addresses, i8/i16/i32/i64 and u8/u16/u32/u64 in their
    own width, i1 and u1 in 32 bits (triton's extractor table; the entry declares .u8, the driver copies its size),
    fp16/bf16 as 16-bit patterns (bf16 by truncating the fp32 bits, as triton does), fp32 as float, fp64 as double;
  * scratch: size > 0 -> size * grid product (* num_ctas on CUDA) bytes aligned to its align, else NULL;
  * block = num_warps * warp_size threads (x only), grid as given, dynamic shared memory = metadata `shared`; on CUDA
    a kernel over 48 KiB gets CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = optin - static at load;
  * launch_cooperative_grid / launch_pdl go through cuLaunchKernelEx (CU_LAUNCH_ATTRIBUTE_COOPERATIVE /
    PROGRAMMATIC_STREAM_SERIALIZATION) or hipModuleLaunchCooperativeKernel; clusters (num_ctas > 1 / cluster_dims),
    tensor descriptors, instrumentation (gsan adds params) and HIP pdl are refused at load.
"""
from __future__ import annotations

import ctypes
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import K3cError

__all__ = ["BinaryKernel", "load_binary", "load_compiled", "check_launchable", "BinaryKernelError", "DriverError",
           "UnsupportedKernelError", "LaunchArgumentError", "PARAM_CTYPES", "INT_RANGES", "num_params"]


class BinaryKernelError(K3cError):
    """Base of the binary loader's errors."""


class DriverError(BinaryKernelError):
    """A driver library that cannot be loaded, or a driver call that failed (names the call and the error)."""


class UnsupportedKernelError(BinaryKernelError):
    """A binary whose signature or metadata needs something this loader does not do (clusters, TMA descriptors...)."""


class LaunchArgumentError(BinaryKernelError):
    """A launch argument of the wrong kind, dtype, device, alignment or range (names kernel and argument)."""


# ---------------------------------------------------------------------------------------------- marshalling tables
# triton type -> ctypes storage of the kernel param (triton 3.9 backends/nvidia/driver.c `extraction_map`; the amd
# table is the same). Pointers are CUdeviceptr / hipDeviceptr_t: 64 bits.
POINTER_CTYPE = ctypes.c_uint64
PARAM_CTYPES: dict[str, type] = {
    "i1": ctypes.c_int32, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32, "i64": ctypes.c_int64,
    "u1": ctypes.c_uint32, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16, "u32": ctypes.c_uint32,
    "u64": ctypes.c_uint64, "fp16": ctypes.c_uint16, "bf16": ctypes.c_uint16, "fp32": ctypes.c_float,
    "f32": ctypes.c_float, "fp64": ctypes.c_double,
}
INT_RANGES: dict[str, tuple[int, int]] = {
    "i1": (0, 1), "u1": (0, 1),
    "i8": (-2 ** 7, 2 ** 7 - 1), "i16": (-2 ** 15, 2 ** 15 - 1), "i32": (-2 ** 31, 2 ** 31 - 1),
    "i64": (-2 ** 63, 2 ** 63 - 1),
    "u8": (0, 2 ** 8 - 1), "u16": (0, 2 ** 16 - 1), "u32": (0, 2 ** 32 - 1), "u64": (0, 2 ** 64 - 1),
}
_FLOAT_TYPES = ("fp16", "bf16", "fp32", "f32", "fp64")
# pointee triton type -> torch dtype attribute name (the JIT's mapping, triton/runtime/jit.py / backends/driver.py)
_POINTEE_TORCH = {
    "i1": "bool", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8", "u16": "uint16",
    "u32": "uint32", "u64": "uint64", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "f32": "float32",
    "fp64": "float64", "fp8e4nv": "float8_e4m3fn", "fp8e5": "float8_e5m2", "fp8e4b8": "float8_e4m3fnuz",
    "fp8e5b16": "float8_e5m2fnuz",
}
BACKENDS = ("cuda", "hip")
GRID_LIMITS = (2 ** 31 - 1, 65535, 65535)
_SMALL_SHARED = 48 * 1024          # CUDA: dynamic shared memory above this needs the opt-in attribute

# kinds of launch arg
_PTR, _INT, _FLOAT, _FP16, _BF16 = range(5)

# CUDA enums (cuda.h)
_CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
_CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


SCRATCH_KINDS = ("global", "profile")     # the trailing scratch pointers, in param order


def num_params(signature: dict[str, str], metadata: dict | None = None) -> int:
    """Params of the kernel entry (triton >= 3.5): the runtime args plus the global and profile scratch pointers."""
    return len(signature) + len(SCRATCH_KINDS)


# ------------------------------------------------------------------------------------------------- launch structs
class _LaunchAttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("int_value", ctypes.c_int), ("_align", ctypes.c_uint64)]


class _LaunchAttr(ctypes.Structure):          # CUlaunchAttribute: id, pad to 8, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class _LaunchConfig(ctypes.Structure):        # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("numAttrs", ctypes.c_uint)]


# --------------------------------------------------------------------------------------------------- the drivers
_u, _vp, _i = ctypes.c_uint, ctypes.c_void_p, ctypes.c_int
_PTR_ARG = ctypes.c_void_p
# name -> (restype, argtypes, required). Both tables give the same roles to _Driver.
_CUDA_API = {
    "cuInit": (_i, [_u], True),
    "cuGetErrorName": (_i, [_i, ctypes.POINTER(ctypes.c_char_p)], True),
    "cuCtxGetCurrent": (_i, [_PTR_ARG], True),
    "cuCtxSetCurrent": (_i, [_vp], True),
    "cuCtxGetDevice": (_i, [_PTR_ARG], True),
    "cuDeviceGet": (_i, [_PTR_ARG, _i], True),
    "cuDevicePrimaryCtxRetain": (_i, [_PTR_ARG, _i], True),
    "cuDevicePrimaryCtxRelease_v2": (_i, [_i], False),
    "cuDeviceGetAttribute": (_i, [_PTR_ARG, _i, _i], True),
    "cuModuleLoadData": (_i, [_PTR_ARG, ctypes.c_char_p], True),
    "cuModuleGetFunction": (_i, [_PTR_ARG, _vp, ctypes.c_char_p], True),
    "cuModuleUnload": (_i, [_vp], True),
    "cuFuncGetAttribute": (_i, [_PTR_ARG, _i, _vp], True),
    "cuFuncSetAttribute": (_i, [_vp, _i, _i], True),
    "cuLaunchKernel": (_i, [_vp, _u, _u, _u, _u, _u, _u, _u, _vp, _vp, _vp], True),
    "cuLaunchKernelEx": (_i, [_PTR_ARG, _vp, _vp, _vp], False),
}
_HIP_API = {
    "hipGetErrorName": (ctypes.c_char_p, [_i], True),
    "hipGetDevice": (_i, [_PTR_ARG], True),
    "hipSetDevice": (_i, [_i], True),
    "hipModuleLoadData": (_i, [_PTR_ARG, ctypes.c_char_p], True),
    "hipModuleGetFunction": (_i, [_PTR_ARG, _vp, ctypes.c_char_p], True),
    "hipModuleUnload": (_i, [_vp], True),
    "hipModuleLaunchKernel": (_i, [_vp, _u, _u, _u, _u, _u, _u, _u, _vp, _vp, _vp], True),
    "hipModuleLaunchCooperativeKernel": (_i, [_vp, _u, _u, _u, _u, _u, _u, _u, _vp, _vp], False),
}


def _find_mapped(fragment: str) -> str | None:
    """Path of an already-loaded shared object whose name contains `fragment` (the one torch uses)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if fragment in os.path.basename(path) and os.path.exists(path):
                    return path
    except OSError:
        pass
    return None


def _library_candidates(backend: str) -> list[str]:
    if backend == "cuda":
        out = []
        if d := os.environ.get("TRITON_LIBCUDA_PATH"):
            out.append(os.path.join(d, "libcuda.so.1") if os.path.isdir(d) else d)
        out.append("libcuda.so.1")
        return out
    out = [p for p in (os.environ.get("TRITON_LIBHIP_PATH"), _find_mapped("libamdhip64.so")) if p]
    out += ["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"]
    try:
        import torch
        out.append(os.path.join(os.path.dirname(torch.__file__), "lib", "libamdhip64.so"))
    except ImportError:
        pass
    return out


def _open_library(backend: str):
    errors = []
    for name in _library_candidates(backend):
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    lib = "libcuda.so.1 (the NVIDIA driver)" if backend == "cuda" else "libamdhip64.so (the HIP runtime)"
    raise DriverError(f"cannot load {lib} to run {backend} kernel binaries: " + "; ".join(errors))


class _Driver:
    """The vendor entry points the loader needs, with errors named by the driver. Handles are ints."""

    def __init__(self, backend: str, lib=None):
        if backend not in BACKENDS:
            raise UnsupportedKernelError(f"no driver for backend '{backend}' (binaries run on: {', '.join(BACKENDS)})")
        self.backend = backend
        self.vendor = "CUDA" if backend == "cuda" else "HIP"
        self.lib = lib if lib is not None else _open_library(backend)
        self.fn = {}
        for name, (restype, argtypes, required) in (_CUDA_API if backend == "cuda" else _HIP_API).items():
            try:
                f = getattr(self.lib, name)
            except AttributeError:
                if required:
                    raise DriverError(f"the {self.vendor} driver library has no {name}") from None
                continue
            try:
                f.restype, f.argtypes = restype, argtypes
            except AttributeError:          # a stand-in function table (tests)
                pass
            self.fn[name] = f
        if backend == "cuda":
            self.check(self.fn["cuInit"](0), "cuInit")
        self._get_current = self.fn["cuCtxGetCurrent" if backend == "cuda" else "hipGetDevice"]
        self._set_current = self.fn["cuCtxSetCurrent" if backend == "cuda" else "hipSetDevice"]

    # -- errors
    def error_name(self, rc: int) -> str:
        try:
            if self.backend == "cuda":
                s = ctypes.c_char_p()
                if self.fn["cuGetErrorName"](rc, ctypes.byref(s)) == 0 and s.value:
                    return s.value.decode()
            else:
                s = self.fn["hipGetErrorName"](rc)
                if s:
                    return s.decode() if isinstance(s, bytes) else str(s)
        except Exception:  # noqa: BLE001 - the name is a courtesy; the code is in the message anyway
            pass
        return "unknown error"

    def check(self, rc: int, call: str, what: str = "") -> None:
        if rc != 0:
            raise DriverError(f"{call} failed with {self.error_name(rc)} ({rc})" + (f": {what}" if what else ""))

    # -- context (CUDA: the CUcontext current on this thread; HIP: the current device)
    def current(self) -> int:
        out = ctypes.c_void_p() if self.backend == "cuda" else ctypes.c_int()
        call = "cuCtxGetCurrent" if self.backend == "cuda" else "hipGetDevice"
        self.check(self._get_current(ctypes.byref(out)), call)
        return out.value or 0

    def set_current(self, handle: int) -> None:
        rc = self._set_current(handle if self.backend == "hip" else (handle or None))
        self.check(rc, "cuCtxSetCurrent" if self.backend == "cuda" else "hipSetDevice")

    def bind(self, device_index: int) -> int:
        """Make device_index's primary context (HIP: the device) current and return its handle. CUDA: the primary
        context is retained (release() gives it back); it is the one torch's runtime uses."""
        if self.backend == "hip":
            if self.current() != device_index:
                self.set_current(device_index)
            return device_index
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check(self.fn["cuDeviceGet"](ctypes.byref(dev), device_index), "cuDeviceGet", f"device {device_index}")
        self.check(self.fn["cuDevicePrimaryCtxRetain"](ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
        if self.current() != (ctx.value or 0):
            self.set_current(ctx.value)
        cur_dev = ctypes.c_int()
        self.check(self.fn["cuCtxGetDevice"](ctypes.byref(cur_dev)), "cuCtxGetDevice")
        if cur_dev.value != dev.value:
            raise DriverError(f"the current CUDA context is for device {cur_dev.value}, not {device_index}")
        return ctx.value or 0

    def release(self, device_index: int) -> None:
        if self.backend == "cuda" and "cuDevicePrimaryCtxRelease_v2" in self.fn:
            dev = ctypes.c_int()
            if self.fn["cuDeviceGet"](ctypes.byref(dev), device_index) == 0:
                self.fn["cuDevicePrimaryCtxRelease_v2"](dev.value)

    # -- modules
    def load_module(self, image: bytes, what: str) -> int:
        mod = ctypes.c_void_p()
        call = "cuModuleLoadData" if self.backend == "cuda" else "hipModuleLoadData"
        self.check(self.fn[call](ctypes.byref(mod), image), call, what)
        return mod.value or 0

    def get_function(self, module: int, name: str, what: str) -> int:
        fn = ctypes.c_void_p()
        call = "cuModuleGetFunction" if self.backend == "cuda" else "hipModuleGetFunction"
        self.check(self.fn[call](ctypes.byref(fn), module, name.encode()), call, what)
        return fn.value or 0

    def unload(self, module: int) -> None:
        self.fn["cuModuleUnload" if self.backend == "cuda" else "hipModuleUnload"](module)

    def prepare_shared(self, function: int, shared: int, device_index: int, what: str) -> None:
        """CUDA: opt a kernel into more than 48 KiB of dynamic shared memory (triton's loadBinary does the same:
        max dynamic = optin - static). HIP takes the LDS size at launch."""
        if self.backend != "cuda" or shared <= _SMALL_SHARED:
            return
        dev, optin, static = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        self.check(self.fn["cuDeviceGet"](ctypes.byref(dev), device_index), "cuDeviceGet", what)
        self.check(self.fn["cuDeviceGetAttribute"](ctypes.byref(optin),
                                                   _CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev.value),
                   "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)", what)
        self.check(self.fn["cuFuncGetAttribute"](ctypes.byref(static), _CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                                 function), "cuFuncGetAttribute(SHARED_SIZE_BYTES)", what)
        if shared + static.value > optin.value:
            raise UnsupportedKernelError(f"{what}: needs {shared} B of dynamic + {static.value} B of static shared "
                                         f"memory; the device allows {optin.value} B per block")
        self.check(self.fn["cuFuncSetAttribute"](function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                 optin.value - static.value),
                   "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", what)


_DRIVERS: dict[str, _Driver] = {}
_DRIVERS_LOCK = threading.Lock()


def _driver(backend: str) -> _Driver:
    with _DRIVERS_LOCK:
        d = _DRIVERS.get(backend)
        if d is None:
            d = _DRIVERS[backend] = _Driver(backend)
        return d


# ------------------------------------------------------------------------------------------------ the torch side
class _TorchHost:
    """What the loader needs from torch: the device guard, the current raw stream, scratch memory, and the device
    index tensors on the kernel's device report. A test substitutes its own."""

    def __init__(self):
        import torch

        self.torch = torch
        self.Tensor = torch.Tensor
        self._raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def current_device(self) -> int:
        self.torch.cuda.init()
        return self.torch.cuda.current_device()

    def guard(self, device_index: int):
        self.torch.cuda.init()
        return self.torch.cuda.device(device_index)

    def raw_stream(self, device_index: int) -> int:
        if self._raw is not None:
            return self._raw(device_index)
        return self.torch.cuda.current_stream(device_index).cuda_stream

    def tensor_device(self, device_index: int) -> int:
        return device_index

    def dtype(self, name: str):
        return getattr(self.torch, name, None)

    def scratch(self, nbytes: int, align: int, device_index: int):
        """(keep-alive object, aligned address) of nbytes on the current stream; the caching allocator returns
        512-byte aligned blocks and only reuses them in stream order after the launch."""
        extra = align - 1 if align > 512 else 0
        t = self.torch.empty(nbytes + extra, dtype=self.torch.uint8, device=f"cuda:{device_index}")
        ptr = t.data_ptr()
        if align > 1:
            ptr = (ptr + align - 1) & ~(align - 1)
        return t, ptr


_HOST: _TorchHost | None = None


def _host() -> _TorchHost:
    global _HOST
    if _HOST is None:
        _HOST = _TorchHost()
    return _HOST


# --------------------------------------------------------------------------------------------------- the kernel
@dataclass(frozen=True)
class _Arg:
    index: int
    name: str
    ty: str
    kind: int
    store: Any           # the ctypes object kernelParams[index] points at
    dtype: Any = None    # pointers: the torch dtype
    aligned: bool = False
    lo: int = 0
    hi: int = 0


class BinaryKernel:
    """One loaded kernel binary on one device. A launch costs ~16 us of host time on the H200 box, the driver's
    cuLaunchKernel included (k3c's JIT launch of the same kernel: ~34 us); the Python part alone is ~4 us."""

    def __init__(self, *, name: str, backend: str, driver: _Driver, host, module: int, function: int, ctx: int,
                 device_index: int, signature: dict[str, str], metadata: dict, divisible_by_16: tuple[str, ...]):
        self.name, self.backend, self.device_index = name, backend, device_index
        self.signature = dict(signature)
        self.metadata = dict(metadata)
        self.divisible_by_16 = tuple(divisible_by_16)
        self._driver, self._host = driver, host
        self._module, self._function, self._ctx = module, function, ctx
        md = metadata
        self.num_warps = int(md["num_warps"])
        self.warp_size = int(md.get("warp_size") or (32 if backend == "cuda" else 64))
        self.block = self.num_warps * self.warp_size
        self.shared = int(md.get("shared", 0) or 0)
        self.num_ctas = int(md.get("num_ctas", 1) or 1)
        self.cooperative = bool(md.get("launch_cooperative_grid", False))
        self.pdl = bool(md.get("launch_pdl", False))
        scratch = []
        for kind in SCRATCH_KINDS:
            size = int(md.get(f"{kind}_scratch_size") or 0)
            align = int(md.get(f"{kind}_scratch_align") or 1)
            scratch.append((kind, size, max(1, align)))
        self.scratch = tuple(scratch)         # (kind, bytes per program, align), in param order

        # params: one ctypes object per param, and the void*[] array of their addresses (built once)
        tensor_device = host.tensor_device(device_index)
        self._tensor_device = tensor_device
        args = []
        for i, (aname, ty) in enumerate(signature.items()):
            if ty.startswith("*"):
                dtype = host.dtype(_POINTEE_TORCH[_pointee(ty)])
                if dtype is None:
                    raise UnsupportedKernelError(f"kernel '{name}': arg '{aname}' ({ty}) has no dtype in this torch")
                args.append(_Arg(i, aname, ty, _PTR, POINTER_CTYPE(), dtype, aname in self.divisible_by_16))
            elif ty in INT_RANGES:
                lo, hi = INT_RANGES[ty]
                args.append(_Arg(i, aname, ty, _INT, PARAM_CTYPES[ty](), lo=lo, hi=hi))
            else:
                kind = _FP16 if ty == "fp16" else _BF16 if ty == "bf16" else _FLOAT
                args.append(_Arg(i, aname, ty, kind, PARAM_CTYPES[ty]()))
        self._args = tuple(args)
        self._nargs = len(args)
        self._scratch_store = tuple(POINTER_CTYPE() for _ in scratch)
        stores = [a.store for a in args] + list(self._scratch_store)
        self.num_params = len(stores)
        self._params = (ctypes.c_void_p * max(1, len(stores)))(*[ctypes.addressof(s) for s in stores])
        self._params_ptr = ctypes.addressof(self._params)
        self._slots = tuple((a.index, a.kind, a.store, a.dtype, a.aligned, a.lo, a.hi) for a in args)
        self._scratch_alloc = tuple((store, size, align) for store, (_k, size, align)
                                    in zip(self._scratch_store, scratch) if size > 0)
        self._grid_factor = self.num_ctas if backend == "cuda" else 1
        self._tensor_type = host.Tensor
        self._raw_stream = host.raw_stream
        fn = driver.fn
        if backend == "cuda" and (self.cooperative or self.pdl):
            self._launch_impl, self._launch_call = self._launch_ex, "cuLaunchKernelEx"
            attrs = []
            if self.pdl:
                attrs.append(_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            if self.cooperative:
                attrs.append(_CU_LAUNCH_ATTRIBUTE_COOPERATIVE)
            self._attrs = (_LaunchAttr * len(attrs))()
            for a, aid in zip(self._attrs, attrs):
                a.id, a.value.int_value = aid, 1
            self._config = _LaunchConfig(blockDimX=self.block, blockDimY=1, blockDimZ=1,
                                         sharedMemBytes=self.shared, attrs=ctypes.addressof(self._attrs),
                                         numAttrs=len(attrs))
            self._config_ref = ctypes.byref(self._config)
            self._cu_launch_ex = _need(fn, "cuLaunchKernelEx", name, "cooperative / pdl launches")
        elif backend == "hip" and self.cooperative:
            self._launch_impl = self._launch_hip_coop
            self._launch_call = "hipModuleLaunchCooperativeKernel"
            self._hip_coop = _need(fn, self._launch_call, name, "cooperative launches")
        else:
            self._launch_impl = self._launch_plain
            self._launch_call = "cuLaunchKernel" if backend == "cuda" else "hipModuleLaunchKernel"
            self._plain = fn[self._launch_call]
        self._get_current = driver._get_current
        self._cur = ctypes.c_void_p() if backend == "cuda" else ctypes.c_int()    # per kernel: no shared state
        self._cur_ref = ctypes.byref(self._cur)
        self._lock = threading.Lock()         # the param storage is per kernel: one launch at a time
        self._closed = False

    def __repr__(self) -> str:
        return (f"BinaryKernel({self.name!r}, {self.backend}, device {self.device_index}, {self.num_params} params, "
                f"block {self.block}, shared {self.shared})")

    # -- launching
    def launch(self, grid: Sequence[int] | int, args: Sequence) -> None:
        """Launch on torch's current stream of the kernel's device. args: the runtime args in signature order
        (tensors, None or raw device addresses for pointers; ints for integer args; floats for float args).
        A grid with a zero dimension launches nothing (as triton)."""
        if self._closed:
            raise BinaryKernelError(f"kernel '{self.name}' was closed")
        if len(args) != self._nargs:
            raise LaunchArgumentError(f"kernel '{self.name}' takes {self._nargs} args "
                                      f"({', '.join(self.signature)}), got {len(args)}")
        try:
            gx, gy, gz = grid
        except (TypeError, ValueError):
            gx, gy, gz = self._grid3(grid)
        if not (0 < gx <= GRID_LIMITS[0] and 0 < gy <= GRID_LIMITS[1] and 0 < gz <= GRID_LIMITS[2]):
            gx, gy, gz = self._grid3((gx, gy, gz))
            if gx * gy * gz == 0:
                return
        lock = self._lock
        lock.acquire()
        try:
            tensor_type, dev = self._tensor_type, self._tensor_device
            for i, kind, store, dtype, aligned, lo, hi in self._slots:
                v = args[i]
                if kind == _PTR:
                    if isinstance(v, tensor_type):
                        if v.dtype is not dtype or v.get_device() != dev:
                            self._bad_tensor(i, v)
                        p = v.data_ptr()
                    elif v is None:
                        p = 0
                    elif type(v) is int:
                        p = v
                        if not 0 <= p < 2 ** 64:
                            self._bad_arg(i, v, "is not a 64-bit device address")
                    else:
                        p = self._bad_arg(i, v, "must be a torch tensor (or None / an int device address)")
                    if aligned and p & 15:
                        self._misaligned(i, p)
                    store.value = p
                elif kind == _INT:
                    if type(v) is not int:
                        v = self._as_int(i, v)
                    if not lo <= v <= hi:
                        self._bad_arg(i, v, f"is out of range [{lo}, {hi}] for {self._args[i].ty}")
                    store.value = v
                else:
                    if type(v) is not float:
                        v = self._as_float(i, v)
                    if kind == _FLOAT:
                        store.value = v
                    else:
                        store.value = self._half_bits(i, v, kind)
            keep = None
            if self._scratch_alloc:
                keep = []
                programs = gx * gy * gz * self._grid_factor
                for store, size, align in self._scratch_alloc:
                    t, p = self._host.scratch(programs * size, align, self.device_index)
                    keep.append(t)
                    store.value = p
            stream = self._raw_stream(self.device_index)
            if self._get_current(self._cur_ref):
                self._driver.current()          # raises, naming the error
            cur = self._cur.value or 0
            if cur == self._ctx:
                rc = self._launch_impl(gx, gy, gz, stream)
            else:                               # another context / device is current on this thread
                self._driver.set_current(self._ctx)
                try:
                    rc = self._launch_impl(gx, gy, gz, stream)
                finally:
                    self._driver.set_current(cur)
            del keep
        finally:
            lock.release()
        if rc != 0:
            self._driver.check(rc, self._launch_call, f"kernel '{self.name}' grid ({gx}, {gy}, {gz}) block "
                                                      f"{self.block} shared {self.shared}")

    __call__ = launch

    def _launch_plain(self, gx, gy, gz, stream):
        f = self._grid_factor
        return self._plain(self._function, gx * f, gy, gz, self.block, 1, 1, self.shared, stream,
                           self._params_ptr, None)

    def _launch_ex(self, gx, gy, gz, stream):
        c = self._config
        c.gridDimX, c.gridDimY, c.gridDimZ, c.hStream = gx * self._grid_factor, gy, gz, stream
        return self._cu_launch_ex(self._config_ref, self._function, self._params_ptr, None)

    def _launch_hip_coop(self, gx, gy, gz, stream):
        return self._hip_coop(self._function, gx, gy, gz, self.block, 1, 1, self.shared, stream, self._params_ptr)

    def close(self) -> None:
        """Unload the module and release the context. Explicit only (never at garbage collection: a captured CUDA
        graph may still launch the function); the caller makes sure no queued work or graph still uses it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        d = self._driver
        cur = d.current()
        if cur != self._ctx:
            d.set_current(self._ctx)
        try:
            d.check(d.fn["cuModuleUnload" if self.backend == "cuda" else "hipModuleUnload"](self._module),
                    "cuModuleUnload" if self.backend == "cuda" else "hipModuleUnload", f"kernel '{self.name}'")
        finally:
            if cur != self._ctx:
                d.set_current(cur)
            d.release(self.device_index)

    # -- error paths (off the hot path)
    def _where(self, i: int) -> str:
        a = self._args[i]
        return f"kernel '{self.name}': arg {i} '{a.name}' ({a.ty})"

    def _bad_arg(self, i: int, v, why: str):
        raise LaunchArgumentError(f"{self._where(i)} {why}; got {type(v).__name__} {_short(v)}")

    def _bad_tensor(self, i: int, v) -> None:
        a = self._args[i]
        if v.dtype != a.dtype:
            raise LaunchArgumentError(f"{self._where(i)} is a {v.dtype} tensor; the binary wants {a.dtype}")
        raise LaunchArgumentError(f"{self._where(i)} is on {v.device}; the kernel is loaded on "
                                  f"{'cuda' if self.backend == 'cuda' else 'cuda (hip)'}:{self.device_index}")

    def _misaligned(self, i: int, p: int) -> None:
        raise LaunchArgumentError(f"{self._where(i)}: address {p:#x} is not 16-byte aligned, but the binary was "
                                  "compiled assuming it is (divisible_by_16); pass an aligned tensor (a fresh "
                                  "allocation or .clone()) or compile with assume_aligned=False")

    def _as_int(self, i: int, v) -> int:
        ty = self._args[i].ty
        if isinstance(v, bool) and ty not in ("i1", "u1"):
            self._bad_arg(i, v, "must be an int, not a bool")
        try:
            import operator

            return operator.index(v)
        except TypeError:
            self._bad_arg(i, v, "must be an int")

    def _as_float(self, i: int, v) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            try:
                import numbers

                if isinstance(v, numbers.Real) and not isinstance(v, bool):
                    return float(v)
            except (TypeError, ValueError):
                pass
            self._bad_arg(i, v, "must be a float")
        return float(v)

    def _half_bits(self, i: int, v: float, kind: int) -> int:
        if kind == _FP16:
            try:
                return struct.unpack("<H", struct.pack("<e", v))[0]
            except (OverflowError, struct.error):
                self._bad_arg(i, v, "does not fit fp16")
        return _bf16_bits(v)

    @staticmethod
    def _grid3(grid) -> tuple[int, int, int]:
        if isinstance(grid, int) and not isinstance(grid, bool):
            grid = (grid,)
        try:
            dims = tuple(int(g) for g in grid)
        except (TypeError, ValueError):
            raise LaunchArgumentError(f"grid must be 1 to 3 ints, got {grid!r}") from None
        if not 1 <= len(dims) <= 3:
            raise LaunchArgumentError(f"grid must be 1 to 3 ints, got {grid!r}")
        dims = dims + (1,) * (3 - len(dims))
        for d, lim, axis in zip(dims, GRID_LIMITS, "xyz"):
            if not 0 <= d <= lim:
                raise LaunchArgumentError(f"grid {axis} = {d} is out of range [0, {lim}]")
        return dims


def _need(fns: dict, call: str, kernel: str, why: str):
    if call not in fns:
        raise UnsupportedKernelError(f"kernel '{kernel}': the driver has no {call}, needed for {why}")
    return fns[call]


def _bf16_bits(v: float) -> int:
    """triton's extractBF16: (float)v, upper 16 bits (truncation)."""
    return (ctypes.c_uint32.from_buffer(ctypes.c_float(v)).value >> 16) & 0xFFFF


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _pointee(ty: str) -> str:
    t = ty[1:]
    if t not in _POINTEE_TORCH and t.startswith("k") and t[1:] in _POINTEE_TORCH:     # '*k': const pointer
        t = t[1:]
    return t


# ---------------------------------------------------------------------------------------------------- loading
def check_launchable(backend: str, entry_name: str, signature: dict[str, str], metadata: dict,
                     divisible_by_16: Sequence[str] = ()) -> None:
    """Raise UnsupportedKernelError (or LaunchArgumentError for a malformed signature) for a kernel this loader
    cannot launch. Needs no device."""
    what = f"kernel '{entry_name}'"
    if backend not in BACKENDS:
        raise UnsupportedKernelError(f"{what}: backend '{backend}' has no binaries to load (have: cuda, hip)")
    md_backend = metadata.get("backend_name")
    if md_backend and md_backend != backend:
        raise UnsupportedKernelError(f"{what}: the binary was compiled for {md_backend}, not {backend}")
    for aname, ty in signature.items():
        if not isinstance(ty, str):
            raise UnsupportedKernelError(f"{what}: arg '{aname}' has type {ty!r} (tuple args are not supported)")
        if ty == "constexpr":
            raise LaunchArgumentError(f"{what}: arg '{aname}' is a constexpr; the signature lists runtime args only "
                                      "(CompiledKernel.signature)")
        if ty.startswith("*"):
            if _pointee(ty) not in _POINTEE_TORCH:
                raise UnsupportedKernelError(f"{what}: arg '{aname}' has pointer type {ty!r}, which has no torch "
                                             "dtype here")
        elif ty not in PARAM_CTYPES:
            kind = "tensor descriptors" if ty.startswith(("tensordesc", "nvTmaDesc")) else f"type {ty!r}"
            raise UnsupportedKernelError(f"{what}: arg '{aname}' is of {kind}, which this loader does not pass")
    for aname in divisible_by_16:
        if not signature.get(aname, "").startswith("*"):
            raise LaunchArgumentError(f"{what}: divisible_by_16 names '{aname}', which is not a pointer arg")
    try:
        num_warps = int(metadata["num_warps"])
    except (KeyError, TypeError, ValueError):
        raise UnsupportedKernelError(f"{what}: metadata has no num_warps") from None
    if backend == "hip" and not metadata.get("warp_size"):
        raise UnsupportedKernelError(f"{what}: hip metadata has no warp_size (32 or 64: needed for the block size)")
    warp = int(metadata.get("warp_size") or 32)
    if not 1 <= num_warps * warp <= 1024:
        raise UnsupportedKernelError(f"{what}: block of {num_warps} warps x {warp} threads is out of range")
    num_ctas = int(metadata.get("num_ctas", 1) or 1)
    cluster = metadata.get("cluster_dims") or (1, 1, 1)
    try:
        cluster_n = 1
        for c in cluster:
            cluster_n *= int(c)
    except (TypeError, ValueError):
        raise UnsupportedKernelError(f"{what}: unreadable cluster_dims {cluster!r}") from None
    if num_ctas != 1 or cluster_n != 1:
        raise UnsupportedKernelError(f"{what}: compiled for CTA clusters (num_ctas={num_ctas}, cluster_dims="
                                     f"{tuple(cluster)}); this loader launches single-CTA kernels only "
                                     "(compile with num_ctas=1)")
    if backend == "hip" and metadata.get("launch_pdl"):
        raise UnsupportedKernelError(f"{what}: launch_pdl is a CUDA feature; the hip binary asks for it")
    if metadata.get("instrumentation_mode"):
        raise UnsupportedKernelError(f"{what}: compiled with instrumentation ({metadata['instrumentation_mode']!r}),"
                                     " which adds params this loader does not pass")
    if metadata.get("tensordesc_meta"):
        raise UnsupportedKernelError(f"{what}: takes host-side tensor descriptors, which this loader does not build")
    for kind in ("global", "profile"):
        if int(metadata.get(f"{kind}_scratch_size", 0) or 0) < 0:
            raise UnsupportedKernelError(f"{what}: negative {kind}_scratch_size")


def load_binary(image: bytes, *, backend: str, entry_name: str, signature: dict[str, str], metadata: dict,
                divisible_by_16: Sequence[str] = (), device_index: int | None = None,
                _driver_: _Driver | None = None, _host_=None) -> BinaryKernel:
    """Load a cubin (cuda) / hsaco (hip) image into device_index's primary context (default: torch's current
    device) and return its `entry_name` kernel. signature: runtime args (name -> triton type) in param order;
    metadata: triton's kernel metadata (CompiledKernel.metadata); divisible_by_16: pointer args the binary assumes
    16-byte aligned (checked at every launch)."""
    check_launchable(backend, entry_name, signature, metadata, divisible_by_16)
    if not isinstance(image, (bytes, bytearray, memoryview)) or not len(image):
        raise BinaryKernelError(f"kernel '{entry_name}': empty or non-bytes binary image")
    host = _host_ if _host_ is not None else _host()
    driver = _driver_ if _driver_ is not None else _driver(backend)
    if device_index is None:
        device_index = host.current_device()
    what = (f"kernel '{entry_name}' ({backend} {metadata.get('arch', '?')}, triton "
            f"{metadata.get('triton_version', '?')}) on device {device_index}")
    with host.guard(device_index):
        ctx = driver.bind(device_index)
        module = driver.load_module(bytes(image), what)
        try:
            function = driver.get_function(module, entry_name, what)
            driver.prepare_shared(function, int(metadata.get("shared", 0) or 0), device_index, what)
        except BaseException:
            driver.unload(module)
            raise
    return BinaryKernel(name=entry_name, backend=backend, driver=driver, host=host, module=module,
                        function=function, ctx=ctx, device_index=device_index, signature=signature,
                        metadata=metadata, divisible_by_16=tuple(divisible_by_16))


def load_compiled(ck, out_dir: str, *, device_index: int | None = None) -> BinaryKernel:
    """load_binary for a k3c.codegen.aot.CompiledKernel whose files are under out_dir."""
    with open(os.path.join(out_dir, ck.binary), "rb") as f:
        image = f.read()
    return load_binary(image, backend=ck.backend, entry_name=ck.entry, signature=ck.signature,
                       metadata=ck.metadata, divisible_by_16=ck.divisible_by_16, device_index=device_index)
