"""k3c.runtime.binary: loading and launching AOT kernel binaries through the driver API.

CPU part: a stand-in driver function table (FakeCuda / FakeHip) records every call, so the marshalled kernelParams,
block / grid / shared sizes, scratch pointers, launch attributes, context handling, argument checks and refusals are
checked without a GPU; the param count is checked against real PTX / AMDGCN triton compiles here. GPU part
(-m gpu): binaries compiled on the machine by k3c.codegen.aot run through the loader and match the JIT and torch."""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import struct
import time

import pytest
import torch

from k3c.errors import K3cError
from k3c.runtime import binary
from k3c.runtime.binary import (INT_RANGES, PARAM_CTYPES, BinaryKernelError, DriverError, LaunchArgumentError,
                                UnsupportedKernelError, load_binary, num_params)

MD39 = {"name": "k", "num_warps": 4, "num_ctas": 1, "warp_size": 32, "shared": 0, "global_scratch_size": 0,
        "global_scratch_align": 1, "profile_scratch_size": 0, "profile_scratch_align": 1,
        "launch_cooperative_grid": False, "launch_pdl": False, "tmem_size": 0, "backend_name": "cuda",
        "arch": "sm90", "triton_version": "3.9.0"}
SIG = {"x_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*fp32", "M": "i32"}


# ------------------------------------------------------------------------------------------------ stand-ins
class FakeLib:
    """A driver function table: methods named like the driver's entry points, recording calls. Out-params arrive
    as ctypes.byref(...) objects (their ._obj is the ctypes value to fill)."""

    errors = {1: b"ERROR_INVALID_VALUE", 209: b"ERROR_NO_BINARY_FOR_GPU", 719: b"ERROR_LAUNCH_FAILED"}

    def __init__(self):
        self.calls: list[tuple] = []
        self.fail: dict[str, int] = {}
        self.launches: list[dict] = []
        self.current = 0

    def _rc(self, name, *args):
        self.calls.append((name, *args))
        return self.fail.get(name, 0)

    def names(self):
        return [c[0] for c in self.calls]


class FakeCuda(FakeLib):
    PRIMARY = 0xC0C0

    def __init__(self, optin=232448, static_shared=0):
        super().__init__()
        self.optin, self.static_shared = optin, static_shared

    def cuInit(self, flags):
        return self._rc("cuInit", flags)

    def cuGetErrorName(self, rc, out):
        if rc not in self.errors:
            return 1
        out._obj.value = b"CUDA_" + self.errors[rc]
        return 0

    def cuCtxGetCurrent(self, out):
        out._obj.value = self.current or None
        return self._rc("cuCtxGetCurrent")

    def cuCtxSetCurrent(self, ctx):
        self.current = ctx or 0
        return self._rc("cuCtxSetCurrent", ctx)

    def cuCtxGetDevice(self, out):
        out._obj.value = 0
        return self._rc("cuCtxGetDevice")

    def cuDeviceGet(self, out, ordinal):
        out._obj.value = ordinal
        return self._rc("cuDeviceGet", ordinal)

    def cuDevicePrimaryCtxRetain(self, out, dev):
        out._obj.value = self.PRIMARY
        return self._rc("cuDevicePrimaryCtxRetain", dev)

    def cuDevicePrimaryCtxRelease_v2(self, dev):
        return self._rc("cuDevicePrimaryCtxRelease_v2", dev)

    def cuDeviceGetAttribute(self, out, attr, dev):
        out._obj.value = self.optin
        return self._rc("cuDeviceGetAttribute", attr, dev)

    def cuModuleLoadData(self, out, image):
        out._obj.value = 0x111
        return self._rc("cuModuleLoadData", image)

    def cuModuleGetFunction(self, out, mod, name):
        out._obj.value = 0x222
        return self._rc("cuModuleGetFunction", mod, name)

    def cuModuleUnload(self, mod):
        return self._rc("cuModuleUnload", mod)

    def cuFuncGetAttribute(self, out, attr, fn):
        out._obj.value = self.static_shared
        return self._rc("cuFuncGetAttribute", attr, fn)

    def cuFuncSetAttribute(self, fn, attr, value):
        return self._rc("cuFuncSetAttribute", fn, attr, value)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.launches.append(dict(call="cuLaunchKernel", fn=fn, grid=(gx, gy, gz), block=(bx, by, bz),
                                  shared=shared, stream=stream, params=params, ctx=self.current))
        return self._rc("cuLaunchKernel")

    def cuLaunchKernelEx(self, config_ref, fn, params, extra):
        c = config_ref._obj
        attrs = (binary._LaunchAttr * c.numAttrs).from_address(c.attrs)
        self.launches.append(dict(call="cuLaunchKernelEx", fn=fn, grid=(c.gridDimX, c.gridDimY, c.gridDimZ),
                                  block=(c.blockDimX, c.blockDimY, c.blockDimZ), shared=c.sharedMemBytes,
                                  stream=c.hStream, params=params,
                                  attrs=[(a.id, a.value.int_value) for a in attrs], ctx=self.current))
        return self._rc("cuLaunchKernelEx")


class FakeHip(FakeLib):
    def __init__(self):
        super().__init__()
        self.device = 0

    def hipGetErrorName(self, rc):
        return b"hip" + self.errors.get(rc, b"ErrorUnknown")

    def hipGetDevice(self, out):
        out._obj.value = self.device
        return self._rc("hipGetDevice")

    def hipSetDevice(self, dev):
        self.device = dev
        return self._rc("hipSetDevice", dev)

    def hipModuleLoadData(self, out, image):
        out._obj.value = 0x333
        return self._rc("hipModuleLoadData", image)

    def hipModuleGetFunction(self, out, mod, name):
        out._obj.value = 0x444
        return self._rc("hipModuleGetFunction", mod, name)

    def hipModuleUnload(self, mod):
        return self._rc("hipModuleUnload", mod)

    def hipModuleLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.launches.append(dict(call="hipModuleLaunchKernel", fn=fn, grid=(gx, gy, gz), block=(bx, by, bz),
                                  shared=shared, stream=stream, params=params))
        return self._rc("hipModuleLaunchKernel")

    def hipModuleLaunchCooperativeKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params):
        self.launches.append(dict(call="hipModuleLaunchCooperativeKernel", fn=fn, grid=(gx, gy, gz),
                                  block=(bx, by, bz), shared=shared, stream=stream, params=params))
        return self._rc("hipModuleLaunchCooperativeKernel")


class CpuHost(binary._TorchHost):
    """The torch side on a CPU: CPU tensors stand in for device tensors (get_device() == -1)."""

    STREAM = 0x5757

    def __init__(self):
        super().__init__()
        self.scratch_calls = []

    def current_device(self):
        return 0

    def guard(self, device_index):
        return contextlib.nullcontext()

    def raw_stream(self, device_index):
        return self.STREAM

    def tensor_device(self, device_index):
        return -1

    def scratch(self, nbytes, align, device_index):
        t = torch.empty(nbytes + align, dtype=torch.uint8)
        p = (t.data_ptr() + align - 1) & ~(align - 1)
        self.scratch_calls.append((nbytes, align))
        return t, p


def load(lib=None, *, backend="cuda", signature=SIG, metadata=None, divisible=("x_ptr", "w_ptr", "out_ptr"),
         host=None):
    lib = lib if lib is not None else (FakeCuda() if backend == "cuda" else FakeHip())
    md = dict(MD39)
    if backend == "hip":                                       # what triton's hip metadata has
        md.update(warp_size=64, backend_name="hip", arch="gfx950")
        md.pop("launch_pdl")
    md.update(metadata or {})
    k = load_binary(b"\x7fELF fake image", backend=backend, entry_name="k", signature=signature, metadata=md,
                    divisible_by_16=divisible, device_index=0, _driver_=binary._Driver(backend, lib),
                    _host_=host or CpuHost())
    return k, lib


def decode(params: int, ctypes_list):
    """The values kernelParams points at, read back as the given ctypes."""
    ptrs = (ctypes.c_void_p * len(ctypes_list)).from_address(params)
    return [ct.from_address(p).value for ct, p in zip(ctypes_list, ptrs)]


def tensors(m=8):
    return torch.randn(m, 64), torch.randn(64).bfloat16(), torch.empty(m, 64)


# ---------------------------------------------------------------------------------------- tables and counts
def _triton_extractors():
    """{type name: (size, signed/unsigned/float)} from the installed triton's nvidia launcher (driver.c)."""
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "driver.c")
    if not os.path.exists(path):
        return None
    src = open(path).read()
    out = {}
    for m in re.finditer(r"\.extract\s*=\s*extract(\w+),\s*\.size\s*=\s*sizeof\((\w+)\),\s*\.name\s*=\s*\{([^}]*)\}",
                         src):
        fn, ctype = m.group(1), m.group(2)
        for name in re.findall(r'"(\w+)"', m.group(3)):
            out[name] = (fn, ctype)
    return out or None


_SIZES = {"int8_t": 1, "int16_t": 2, "int32_t": 4, "int64_t": 8, "uint8_t": 1, "uint16_t": 2, "uint32_t": 4,
          "uint64_t": 8}


def test_param_ctypes_match_triton_launcher_table():
    table = _triton_extractors()
    if table is None:
        pytest.skip("the installed triton has no driver.c extractor table (older launcher)")
    for name, (fn, ctype) in table.items():
        if name == "nvTmaDesc":
            continue
        ours = PARAM_CTYPES[name]
        assert ctypes.sizeof(ours) == _SIZES[ctype], name
        if fn.startswith("I"):
            assert ours(-1).value == -1, name                  # signed
        elif fn.startswith("U"):
            assert ours(-1).value > 0, name                    # unsigned
    assert set(PARAM_CTYPES) >= {k for k in table if k != "nvTmaDesc"}
    # i1 / u1 go in 32 bits (triton's table), bf16 / fp16 as 16-bit patterns
    assert PARAM_CTYPES["i1"] is ctypes.c_int32 and PARAM_CTYPES["u1"] is ctypes.c_uint32
    assert ctypes.sizeof(PARAM_CTYPES["bf16"]) == 2 and PARAM_CTYPES["fp32"] is ctypes.c_float


def test_num_params_from_signature():
    assert num_params(SIG, MD39) == 6                          # 4 runtime args + global + profile scratch
    k, _ = load()
    assert k.num_params == 6 and len(k._params) == 6
    # metadata without the scratch keys (triton 3.6's hip metadata lacks one): still both pointers, NULL
    bare = {k: v for k, v in MD39.items() if "scratch" not in k}
    lib = FakeCuda()
    k = load_binary(b"img", backend="cuda", entry_name="k", signature=SIG, metadata=bare, device_index=0,
                    _driver_=binary._Driver("cuda", lib), _host_=CpuHost())
    assert k.num_params == 6
    k.launch((1, 1, 1), list(tensors()) + [8])
    assert decode(lib.launches[0]["params"], [ctypes.c_uint64] * 6)[4:] == [0, 0]


@pytest.fixture(scope="module")
def aot_rmsnorm(aot_dir):
    """rmsnorm D=64 fp32 compiled here for h200 (PTX) and mi355x (AMDGCN) with the installed triton."""
    from k3c.codegen.aot import compile_kernels
    from k3c.codegen.kernels import emit_rmsnorm
    from k3c.codegen.targets import get_target

    out = {}
    for tname in ("h200", "mi355x"):
        tgt = get_target(tname)
        ks = emit_rmsnorm(64, 1e-6, target=tgt, dtype="fp32", interpret=False)
        d = aot_dir / tname
        try:
            [ck] = compile_kernels([ks], tgt, str(d), progress=False)
        except K3cError as exc:
            pytest.skip(f"cannot AOT-compile for {tname} here: {exc}")
        out[tname] = (ck, d)
    return out


def test_param_count_matches_compiled_entry(aot_rmsnorm):
    ck, d = aot_rmsnorm["h200"]
    ptx = (d / ck.files["ptx"]).read_text()
    entry = re.search(r"\.entry\s+" + ck.entry + r"\((.*?)\)", ptx, re.S).group(1)
    assert len(re.findall(r"\.param\s", entry)) == num_params(ck.signature, ck.metadata)
    ck, d = aot_rmsnorm["mi355x"]
    asm = (d / ck.files["amdgcn"]).read_text()
    args = asm[asm.index("amdhsa.kernels"):].split(".args:", 1)[1].split(".group_segment_fixed_size", 1)[0]
    kinds = re.findall(r"\.value_kind:\s+(\w+)", args)
    assert len([k for k in kinds if not k.startswith("hidden")]) == num_params(ck.signature, ck.metadata)


# ------------------------------------------------------------------------------------------------ marshalling
def test_marshalling_block_grid_stream_and_null_scratch():
    k, lib = load()
    x, w, out = tensors()
    k.launch((8, 2, 3), [x, w, out, 8])
    [rec] = lib.launches
    assert rec["call"] == "cuLaunchKernel" and rec["fn"] == 0x222
    assert rec["grid"] == (8, 2, 3) and rec["block"] == (128, 1, 1) and rec["shared"] == 0
    assert rec["stream"] == CpuHost.STREAM and rec["ctx"] == FakeCuda.PRIMARY
    vals = decode(rec["params"], [ctypes.c_uint64] * 3 + [ctypes.c_int32] + [ctypes.c_uint64] * 2)
    assert vals[:4] == [x.data_ptr(), w.data_ptr(), out.data_ptr(), 8]
    assert vals[4:] == [0, 0]                                  # global / profile scratch: NULL when size 0


def test_marshalling_every_scalar_type():
    sig = {"p": "*u8", "a": "i1", "b": "i8", "c": "i16", "d": "i32", "e": "i64", "f": "u8", "g": "u16", "h": "u32",
           "i": "u64", "j": "fp16", "k": "bf16", "l": "fp32", "m": "fp64", "n": "u1"}
    k, lib = load(signature=sig, divisible=())
    args = [None, True, -128, -32768, -2 ** 31, -2 ** 63, 255, 65535, 2 ** 32 - 1, 2 ** 64 - 1, 1.0, -2.5, 0.1,
            0.1, 1]
    k.launch((1, 1, 1), args)
    types = [ctypes.c_uint64] + [PARAM_CTYPES[t] for t in list(sig.values())[1:]]
    vals = decode(lib.launches[0]["params"], types)
    assert vals[0] == 0 and vals[1] == 1 and vals[2:10] == args[2:10]
    assert vals[10] == 0x3C00                                  # fp16 1.0
    assert vals[11] == struct.unpack("<I", struct.pack("<f", -2.5))[0] >> 16 == 0xC020
    assert vals[12] == pytest.approx(0.1, rel=1e-7) and vals[12] != 0.1      # rounded to fp32
    assert vals[13] == 0.1 and vals[14] == 1
    # ints for float args, numpy-style scalars through operator.index / float
    import numpy as np
    k.launch((1, 1, 1), [0, np.int8(1), np.int64(-1), 0, 7, 0, 0, 0, 0, 0, 2, 3, np.float32(1.5), 4, False])
    vals = decode(lib.launches[1]["params"], types)
    assert vals[1] == 1 and vals[2] == -1 and vals[4] == 7 and vals[12] == 1.5 and vals[14] == 0


def test_bf16_truncates_like_triton():
    # triton's extractBF16 keeps the upper 16 bits of the fp32 pattern (no rounding)
    v = struct.unpack("<f", struct.pack("<I", 0x3F80FFFF))[0]
    assert binary._bf16_bits(v) == 0x3F80
    assert binary._bf16_bits(float("inf")) == 0x7F80 and binary._bf16_bits(1e39) == 0x7F80


def test_global_scratch_sized_by_grid_and_aligned():
    host = CpuHost()
    k, lib = load(metadata={"global_scratch_size": 256, "global_scratch_align": 128}, host=host)
    x, w, out = tensors()
    k.launch((3, 2, 1), [x, w, out, 8])
    assert host.scratch_calls == [(256 * 6, 128)]
    vals = decode(lib.launches[0]["params"], [ctypes.c_uint64] * 6)
    assert vals[4] != 0 and vals[4] % 128 == 0 and vals[5] == 0


def test_hip_path():
    host = CpuHost()
    k, lib = load(backend="hip", metadata={"num_warps": 2, "global_scratch_size": 64, "global_scratch_align": 16,
                                           "shared": 65536}, host=host)
    assert "hipModuleLoadData" in lib.names() and ("hipModuleGetFunction", 0x333, b"k") in lib.calls
    x, w, out = tensors()
    k.launch((5, 1, 1), [x, w, out, 8])
    [rec] = lib.launches
    assert rec["call"] == "hipModuleLaunchKernel" and rec["block"] == (128, 1, 1) and rec["shared"] == 65536
    assert host.scratch_calls == [(64 * 5, 16)]
    assert decode(rec["params"], [ctypes.c_uint64] * 3 + [ctypes.c_int32])[3] == 8
    kc, lib = load(backend="hip", metadata={"launch_cooperative_grid": True})
    kc.launch((2, 1, 1), [x, w, out, 8])
    assert lib.launches[0]["call"] == "hipModuleLaunchCooperativeKernel"


def test_hip_device_switched_for_the_launch_and_back():
    k, lib = load(backend="hip")
    lib.device = 1                                             # torch's current device is another GPU
    x, w, out = tensors()
    k.launch((1, 1, 1), [x, w, out, 8])
    assert [c for c in lib.calls if c[0] == "hipSetDevice"][-2:] == [("hipSetDevice", 0), ("hipSetDevice", 1)]
    assert lib.device == 1


# --------------------------------------------------------------------------------- launch config and context
def test_large_shared_opts_in_at_load():
    lib = FakeCuda(optin=232448, static_shared=1024)
    k, _ = load(lib, metadata={"shared": 100_000})
    assert ("cuFuncSetAttribute", 0x222, 8, 232448 - 1024) in lib.calls
    x, w, out = tensors()
    k.launch((1, 1, 1), [x, w, out, 8])
    assert lib.launches[0]["shared"] == 100_000
    small = FakeCuda()
    load(small, metadata={"shared": 48 * 1024})
    assert "cuFuncSetAttribute" not in small.names()
    with pytest.raises(UnsupportedKernelError, match="232448 B per block"):
        load(FakeCuda(static_shared=0), metadata={"shared": 240_000})


@pytest.mark.parametrize("flags, attrs", [({"launch_pdl": True}, [(6, 1)]),
                                          ({"launch_cooperative_grid": True}, [(2, 1)]),
                                          ({"launch_pdl": True, "launch_cooperative_grid": True}, [(6, 1), (2, 1)])])
def test_cooperative_and_pdl_use_launch_kernel_ex(flags, attrs):
    k, lib = load(metadata=dict(flags, shared=1234, num_warps=8))
    x, w, out = tensors()
    k.launch((4, 3, 2), [x, w, out, 8])
    [rec] = lib.launches
    assert rec["call"] == "cuLaunchKernelEx" and rec["attrs"] == attrs
    assert rec["grid"] == (4, 3, 2) and rec["block"] == (256, 1, 1) and rec["shared"] == 1234
    assert rec["stream"] == CpuHost.STREAM
    assert decode(rec["params"], [ctypes.c_uint64] * 3 + [ctypes.c_int32])[3] == 8


def test_context_made_current_for_the_launch_and_restored():
    lib = FakeCuda()
    k, _ = load(lib)
    assert lib.current == FakeCuda.PRIMARY                    # load made the primary context current
    x, w, out = tensors()
    lib.current = 0xBEEF                                      # another context on this thread at launch time
    k.launch((1, 1, 1), [x, w, out, 8])
    assert lib.launches[0]["ctx"] == FakeCuda.PRIMARY and lib.current == 0xBEEF
    lib.current = 0                                           # none current: set, then restored to none
    k.launch((1, 1, 1), [x, w, out, 8])
    assert lib.launches[1]["ctx"] == FakeCuda.PRIMARY and lib.current == 0
    n = len(lib.calls)
    lib.current = FakeCuda.PRIMARY
    k.launch((1, 1, 1), [x, w, out, 8])
    assert [c[0] for c in lib.calls[n:]] == ["cuCtxGetCurrent", "cuLaunchKernel"]   # the common case: 2 calls


def test_zero_grid_launches_nothing_and_bad_grid_refused():
    k, lib = load()
    x, w, out = tensors()
    k.launch((0, 1, 1), [x, w, out, 8])
    k.launch(0, [x, w, out, 8])
    assert lib.launches == []
    k.launch(5, [x, w, out, 8])
    k.launch((5, 2), [x, w, out, 8])
    assert [r["grid"] for r in lib.launches] == [(5, 1, 1), (5, 2, 1)]
    with pytest.raises(LaunchArgumentError, match="grid y = 70000"):
        k.launch((1, 70000, 1), [x, w, out, 8])
    with pytest.raises(LaunchArgumentError, match="grid x = -1"):
        k.launch((-1, 1, 1), [x, w, out, 8])


def test_close_unloads_in_the_kernel_context():
    lib = FakeCuda()
    k, _ = load(lib)
    lib.current = 0xBEEF
    k.close()
    k.close()
    assert lib.names().count("cuModuleUnload") == 1 and lib.current == 0xBEEF
    assert "cuDevicePrimaryCtxRelease_v2" in lib.names()
    with pytest.raises(BinaryKernelError, match="closed"):
        k.launch((1, 1, 1), list(tensors()) + [8])


# ---------------------------------------------------------------------------------------------- arg checks
def test_dtype_device_kind_and_count_checks_name_kernel_and_arg():
    k, _ = load()
    x, w, out = tensors()
    with pytest.raises(LaunchArgumentError, match=r"kernel 'k': arg 1 'w_ptr' \(\*bf16\) is a torch.float32 "
                                                  r"tensor; the binary wants torch.bfloat16"):
        k.launch((1, 1, 1), [x, w.float(), out, 8])
    with pytest.raises(LaunchArgumentError, match="takes 4 args"):
        k.launch((1, 1, 1), [x, w, out])
    with pytest.raises(LaunchArgumentError, match="'x_ptr'.*must be a torch tensor"):
        k.launch((1, 1, 1), [x.numpy(), w, out, 8])
    kd, _ = load(host=type("H", (CpuHost,), {"tensor_device": lambda self, i: 0})())
    with pytest.raises(LaunchArgumentError, match=r"'x_ptr'.*is on cpu; the kernel is loaded on cuda:0"):
        kd.launch((1, 1, 1), [x, w, out, 8])


def test_alignment_checked_for_divisible_pointers_only():
    k, lib = load(divisible=("x_ptr",))
    x, w, out = tensors()
    xs = x.view(-1)[1:]                                        # 4 bytes past a 16-aligned base
    with pytest.raises(LaunchArgumentError, match=r"kernel 'k': arg 0 'x_ptr' .*not 16-byte aligned"):
        k.launch((1, 1, 1), [xs, w, out, 8])
    with pytest.raises(LaunchArgumentError, match="not 16-byte aligned"):
        k.launch((1, 1, 1), [x.data_ptr() + 8, w, out, 8])
    k.launch((1, 1, 1), [x, w, out.view(-1)[1:], 8])           # out_ptr not divisible_by_16: fine
    assert len(lib.launches) == 1


@pytest.mark.parametrize("ty, bad", [("i32", 2 ** 31), ("i32", -2 ** 31 - 1), ("u8", -1), ("u8", 256),
                                     ("i1", 2), ("i64", 2 ** 63), ("u64", -1), ("u32", 2 ** 32)])
def test_int_ranges(ty, bad):
    k, _ = load(signature={"n": ty}, divisible=())
    lo, hi = INT_RANGES[ty]
    k.launch((1, 1, 1), [lo])
    k.launch((1, 1, 1), [hi])
    with pytest.raises(LaunchArgumentError, match=rf"arg 0 'n' \({ty}\) is out of range"):
        k.launch((1, 1, 1), [bad])


def test_scalar_kind_checks():
    k, _ = load(signature={"n": "i32", "f": "fp32", "h": "fp16"}, divisible=())
    with pytest.raises(LaunchArgumentError, match="'n'.*must be an int, not a bool"):
        k.launch((1, 1, 1), [True, 1.0, 1.0])
    with pytest.raises(LaunchArgumentError, match="'n'.*must be an int"):
        k.launch((1, 1, 1), [1.5, 1.0, 1.0])
    with pytest.raises(LaunchArgumentError, match="'f'.*must be a float"):
        k.launch((1, 1, 1), [1, "1.0", 1.0])
    with pytest.raises(LaunchArgumentError, match="'h'.*does not fit fp16"):
        k.launch((1, 1, 1), [1, 1.0, 1e6])


# ------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("backend, md, sig, match", [
    ("cuda", {"num_ctas": 2}, None, "CTA clusters"),
    ("cuda", {"cluster_dims": [1, 2, 1]}, None, "CTA clusters"),
    ("cuda", {"instrumentation_mode": "gsan"}, None, "instrumentation"),
    ("cuda", {"tensordesc_meta": [{"swizzle": 3}]}, None, "tensor descriptors"),
    ("cuda", {}, {"d": "tensordesc<fp16[64, 64]>"}, "tensor descriptors"),
    ("cuda", {}, {"d": "nvTmaDesc"}, "tensor descriptors"),
    ("cuda", {}, {"p": "*fp4x9"}, "no torch dtype"),
    ("cuda", {"backend_name": "hip"}, None, "compiled for hip"),
    ("cuda", {"num_warps": 64}, None, "out of range"),
    ("hip", {"launch_pdl": True}, None, "launch_pdl"),
    ("hip", {"warp_size": None}, None, "no warp_size"),
    ("rocm", {}, None, "backend 'rocm'"),
])
def test_unsupported_kernels_refused(backend, md, sig, match):
    md = dict(MD39, **md)
    if backend == "hip":
        md["backend_name"] = "hip"
    with pytest.raises(UnsupportedKernelError, match=match):
        load_binary(b"x", backend=backend, entry_name="k", signature=sig or SIG, metadata=md,
                    device_index=0, _driver_=object(), _host_=CpuHost())


def test_malformed_signature_refused():
    with pytest.raises(LaunchArgumentError, match="'D' is a constexpr"):
        load(signature=dict(SIG, D="constexpr"))
    with pytest.raises(LaunchArgumentError, match="divisible_by_16 names 'M'"):
        load(divisible=("M",))


# ---------------------------------------------------------------------------------------------- driver errors
def test_driver_errors_are_named():
    lib = FakeCuda()
    lib.fail["cuModuleLoadData"] = 209
    with pytest.raises(DriverError, match=r"cuModuleLoadData failed with CUDA_ERROR_NO_BINARY_FOR_GPU \(209\): "
                                          r"kernel 'k' \(cuda sm90, triton 3.9.0\) on device 0"):
        load(lib)
    lib = FakeCuda()
    lib.fail["cuModuleGetFunction"] = 1
    with pytest.raises(DriverError, match="cuModuleGetFunction failed with CUDA_ERROR_INVALID_VALUE"):
        load(lib)
    assert "cuModuleUnload" in lib.names()                    # the module is not leaked
    k, lib = load()
    lib.fail["cuLaunchKernel"] = 719
    with pytest.raises(DriverError, match=r"cuLaunchKernel failed with CUDA_ERROR_LAUNCH_FAILED \(719\): kernel 'k' "
                                          r"grid \(2, 1, 1\) block 128"):
        k.launch((2, 1, 1), list(tensors()) + [8])
    hk, hlib = load(backend="hip")
    hlib.fail["hipModuleLaunchKernel"] = 1
    with pytest.raises(DriverError, match="hipModuleLaunchKernel failed with hipERROR_INVALID_VALUE"):
        hk.launch((1, 1, 1), list(tensors()) + [8])
    lib = FakeCuda()
    lib.fail["cuGetErrorName"] = 1
    lib.fail["cuModuleLoadData"] = 12345
    with pytest.raises(DriverError, match=r"unknown error \(12345\)"):
        load(lib)


def test_missing_driver_library_is_a_k3c_error(monkeypatch):
    monkeypatch.setattr(binary, "_library_candidates", lambda backend: ["/nonexistent/libcuda.so.1"])
    with pytest.raises(DriverError, match=r"cannot load libcuda.so.1 \(the NVIDIA driver\).*nonexistent") as info:
        binary._Driver("cuda")
    assert isinstance(info.value, K3cError)
    with pytest.raises(DriverError, match=r"cannot load libamdhip64.so \(the HIP runtime\)"):
        binary._Driver("hip")


def test_missing_entry_point_is_named():
    class NoLaunch(FakeCuda):
        cuLaunchKernel = property(lambda self: (_ for _ in ()).throw(AttributeError("cuLaunchKernel")))
    with pytest.raises(DriverError, match="has no cuLaunchKernel"):
        binary._Driver("cuda", NoLaunch())


def test_a_launch_is_two_driver_calls():
    """What stays per launch once the kernel is loaded: the current-context check and the launch itself (module,
    function handle, attributes and the argument layout are settled at load). The host cost in microseconds is a
    benchmark's to measure (a timed unit test fails on a loaded machine), not this test's."""
    k, lib = load()
    args = list(tensors()) + [8]
    k.launch((8, 1, 1), args)
    first = len(lib.calls)
    for _ in range(5):
        k.launch((8, 1, 1), args)
    assert lib.names()[first:] == ["cuCtxGetCurrent", "cuLaunchKernel"] * 5
    assert len(lib.launches) == 6


# ====================================================================================================== GPU
def _device_target():
    from k3c.codegen.targets import get_target

    try:
        from k3c.runtime.devices import target_for

        return target_for(torch.device("cuda", torch.cuda.current_device()))
    except Exception:  # noqa: BLE001 - the GPU box is an H200
        return get_target("h200")


def _compile(ks, out_dir, **kw):
    from k3c.codegen.aot import compile_kernels

    [ck] = compile_kernels([ks], _device_target(), str(out_dir), progress=False, **kw)
    return ck


def _jit():
    """The JIT launcher module."""
    from k3c.runtime import launcher

    return launcher


def _grid(ck, **env):
    ints = {k: v for k, v in ck.constexprs.items() if isinstance(v, int) and not isinstance(v, bool)}
    return _jit().eval_grid(ck.grid, {**ints, **env})


def _rms_ref(x, w, eps=1e-6):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


@pytest.fixture(scope="module")
def gpu_rmsnorm(aot_dir):
    from k3c.codegen.kernels import emit_rmsnorm

    ks = emit_rmsnorm(64, 1e-6, target=_device_target(), dtype="fp32", interpret=False)
    ck = _compile(ks, aot_dir / "rms")
    return ks, ck, aot_dir / "rms"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_rmsnorm_binary_equals_jit_and_torch(gpu_rmsnorm):
    launch = _jit().launch
    ks, ck, d = gpu_rmsnorm
    k = binary.load_compiled(ck, str(d))
    print(k, ck.metadata.get("triton_version"))
    ptx = (d / ck.files["ptx"]).read_text()
    entry = re.search(r"\.entry\s+" + ck.entry + r"\((.*?)\)", ptx, re.S).group(1)
    assert len(re.findall(r"\.param\s", entry)) == k.num_params
    g = torch.Generator(device="cuda").manual_seed(0)
    M = 37
    x = torch.randn(M, 64, device="cuda", generator=g)
    w = torch.randn(64, device="cuda", generator=g)
    out_bin, out_jit = torch.empty_like(x), torch.empty_like(x)
    k.launch(_grid(ck, M=M), [x, w, out_bin, M])
    launch(ks, x, w, out_jit, M)
    torch.cuda.synchronize()
    assert torch.equal(out_bin, out_jit)
    torch.testing.assert_close(out_bin, _rms_ref(x, w), rtol=1e-5, atol=1e-5)
    # on a side stream, and from a CUDA graph
    s = torch.cuda.Stream()
    out_s = torch.zeros_like(x)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        k.launch(_grid(ck, M=M), [x, w, out_s, M])
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(out_s, out_jit)
    out_g = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k.launch(_grid(ck, M=M), [x, w, out_g, M])
    x.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out_g, _rms_ref(x, w), rtol=1e-5, atol=1e-5)
    # checks before any launch
    with pytest.raises(LaunchArgumentError, match="not 16-byte aligned"):
        k.launch(_grid(ck, M=M - 1), [x.view(-1)[1:], w, out_bin, M - 1])
    with pytest.raises(LaunchArgumentError, match="is on cpu"):
        k.launch(_grid(ck, M=M), [x.cpu(), w, out_bin, M])
    # host overhead per launch, against the JIT path
    grid = _grid(ck, M=M)
    args = [x, w, out_bin, M]
    for _ in range(100):
        k.launch(grid, args)
    torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        k.launch(grid, args)
    t_bin = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        launch(ks, x, w, out_jit, M)
    t_jit = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"host overhead per launch: binary {t_bin:.1f} us, k3c JIT launch {t_jit:.1f} us")
    assert t_bin < 50


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("option", ["launch_pdl", "launch_cooperative_grid"])
def test_gpu_pdl_and_cooperative(gpu_rmsnorm, aot_dir, option):
    ks, _, _ = gpu_rmsnorm
    d = aot_dir / option
    try:
        ck = _compile(ks, d, triton_options={option: True})
    except K3cError as exc:
        pytest.skip(f"this triton cannot compile with {option}: {str(exc).splitlines()[0]}")
    if not ck.metadata.get(option):
        pytest.skip(f"this triton does not record {option} in the metadata")
    k = binary.load_compiled(ck, str(d))
    assert k._launch_call == "cuLaunchKernelEx"
    M = 20
    x = torch.randn(M, 64, device="cuda")
    w = torch.randn(64, device="cuda")
    out = torch.empty_like(x)
    k.launch(_grid(ck, M=M), [x, w, out, M])
    torch.cuda.synchronize()
    torch.testing.assert_close(out, _rms_ref(x, w), rtol=1e-5, atol=1e-5)


TRANSPOSE = '''import triton
import triton.language as tl


@triton.jit
def k3c_test_transpose(x_ptr, y_ptr, B: tl.constexpr):
    r = tl.arange(0, B)
    x = tl.load(x_ptr + r[:, None] * B + r[None, :])
    tl.store(y_ptr + r[:, None] * B + r[None, :], tl.trans(x) * 2.0)
'''

TMA_COPY = '''import triton
import triton.language as tl


@triton.jit
def k3c_test_tma_copy(x_ptr, y_ptr, M, N: tl.constexpr, BM: tl.constexpr):
    pid = tl.program_id(0)
    xd = tl.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, N])
    yd = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, N])
    yd.store([pid * BM, 0], xd.load([pid * BM, 0]) * 2.0)
'''


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_large_shared_memory(aot_dir):
    from k3c.codegen.kernel import KernelSource

    ks = KernelSource(name="k3c_test_transpose", source=TRANSPOSE, signature={"x_ptr": "*fp32", "y_ptr": "*fp32"},
                      constexprs={"B": 128}, grid=("1",), num_warps=8, num_stages=1)
    ck = _compile(ks, aot_dir / "transpose")
    print("transpose shared", ck.metadata.get("shared"))
    if ck.metadata.get("shared", 0) <= 48 * 1024:
        pytest.skip(f"the transpose uses only {ck.metadata.get('shared')} B of shared memory here")
    k = binary.load_compiled(ck, str(aot_dir / "transpose"))
    x = torch.randn(128, 128, device="cuda")
    y = torch.empty_like(x)
    k.launch((1, 1, 1), [x, y])
    torch.cuda.synchronize()
    assert torch.equal(y, x.T * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_global_scratch(aot_dir):
    from k3c.codegen.kernel import KernelSource

    ks = KernelSource(name="k3c_test_tma_copy", source=TMA_COPY, signature={"x_ptr": "*fp32", "y_ptr": "*fp32",
                                                                             "M": "i32"},
                      constexprs={"N": 64, "BM": 32}, grid=("cdiv(M, BM)",), num_warps=4, num_stages=1)
    try:
        ck = _compile(ks, aot_dir / "tma")
    except K3cError as exc:
        pytest.skip(f"device-side tensor descriptors do not compile here: {str(exc).splitlines()[0]}")
    print("tma copy scratch", ck.metadata.get("global_scratch_size"), ck.metadata.get("global_scratch_align"))
    assert ck.metadata.get("global_scratch_size", 0) > 0
    k = binary.load_compiled(ck, str(aot_dir / "tma"))
    M = 200
    x = torch.randn(M, 64, device="cuda")
    y = torch.full_like(x, float("nan"))
    k.launch(_grid(ck, M=M), [x, y, M])
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)
