"""Target table (DESIGN.md): frozen option objects. Block sizes and layouts come from these, never from
`if target == ...` scattered through the code."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ArgumentError


@dataclass(frozen=True)
class Target:
    name: str
    backend: str                  # hip | cuda | cpu
    arch: str                     # gfx950, gfx942, sm_90, sm_100, sm_103, cpu
    warp_size: int
    shared_mem_bytes: int         # planning budget per block (LDS on AMD)
    native_mxfp4: bool
    peak_bf16_flops: float        # dense, FLOP/s
    peak_fp8_flops: float
    peak_fp4_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: int
    link_bytes_per_s: float       # per-GPU scale-up bandwidth, one direction, all links (MI355X: 7 xGMI x 153.6 GB/s
                                  # bidirectional = 537.6 GB/s each way; MI300X 7 x 128 / 2; H100/H200 NVLink4
                                  # 900 / 2; B200 NVLink5 1800 / 2)
    kda_chunk: int = 64
    mla_page_size: int = 64
    collective_latency_s: float = 10e-6   # one small collective (decode all-reduce, replayed from a CUDA graph):
                                          # measured where a row sets it (docs/perf.md), assumed elsewhere
    plan_fraction: tuple[tuple[str, float, float], ...] = ()
    tiers: tuple[str, ...] = ()   # kernel tiers beyond the portable one (k3c.codegen.tiers) that plans may pick here
    expert_layout: str = "canonical"   # load-time layout of routed MXFP4 expert stacks (weight_prep): "canonical"
                                       # (k3c.quant's, the native-MX and upcast forms) or "hopper" (sm_90: the hopper
                                       # form, k3c.codegen.kernels.moe_hopper)
    # (phase, low, high): the share of `k3c plan`'s roofline tokens/s that k3c's measured end-to-end runs reach on
    # this target (bench/plan_check.py over the checked-in JSONs); empty where nothing was measured

    def has_tier(self, tier: str) -> bool:
        """Whether plan functions may choose `tier`'s kernels for this target (the portable tier: always)."""
        return tier == "portable" or tier in self.tiers

    def plan_fraction_of(self, phase: str) -> tuple[float, float] | None:
        """(low, high) measured share of the plan's tokens/s for a plan phase on this target, or None."""
        for name, lo, hi in self.plan_fraction:
            if name == phase:
                return lo, hi
        return None

    @property
    def triton_target(self):
        """(backend, arch, warp_size) for triton.backends.compiler.GPUTarget; None for the CPU."""
        if self.backend == "cpu":
            return None
        arch = int(self.arch[3:]) if self.backend == "cuda" else self.arch
        return (self.backend, arch, self.warp_size)


KiB, GiB = 1024, 1024 ** 3
HOPPER_TIERS = ("hopper",)    # Gluon kernels for sm_90a (k3c.codegen.tiers)
TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("mi355x", "hip", "gfx950", 64, 160 * KiB, True, 2.5e15, 5.0e15, 10.0e15, 8.0e12, 288 * GiB, 537.6e9),
    Target("mi300x", "hip", "gfx942", 64, 64 * KiB, False, 1.307e15, 2.615e15, 2.615e15, 5.3e12, 192 * GiB, 448e9),
    Target("h100", "cuda", "sm_90", 32, 227 * KiB, False, 0.989e15, 1.979e15, 1.979e15, 3.35e12, 80 * GiB, 450e9,
           tiers=HOPPER_TIERS, expert_layout="hopper"),
    # h200: HBM bandwidth and size are the spec sheet's (what a device copy reaches: docs/perf.md)
    Target("h200", "cuda", "sm_90", 32, 227 * KiB, False, 0.989e15, 1.979e15, 1.979e15, 4.8e12, 141 * GiB, 450e9,
           collective_latency_s=9e-6,
           plan_fraction=(("prefill", 0.44, 0.63), ("decode", 0.48, 0.62)),   # bench/plan-check-h200.json
           tiers=HOPPER_TIERS, expert_layout="hopper"),
    Target("b200", "cuda", "sm_100", 32, 227 * KiB, True, 2.25e15, 4.5e15, 9.0e15, 8.0e12, 180 * GiB, 900e9),
    # b300 (Blackwell Ultra, compute capability 10.3: triton 3.9 emits sm_103a cubins with tcgen05 kind::mxf4).
    # Spec-sheet values (HGX B300, per GPU): 288 GB HBM3e (8 x 36 GiB stacks, held as GiB like mi355x's 288), 8 TB/s,
    # NVLink 5 1.8 TB/s bidirectional; dense BF16 2.25 / FP8 4.5 / FP4 13.5 PFLOP/s (the sheet's 36 / 72 PFLOP/s
    # with sparsity and 108 PFLOP/s dense FP4 for 8 GPUs). Nothing here is measured; the latency is the default.
    Target("b300", "cuda", "sm_103", 32, 227 * KiB, True, 2.25e15, 4.5e15, 13.5e15, 8.0e12, 288 * GiB, 900e9),
    Target("cpu", "cpu", "cpu", 1, 0, False, 1e12, 1e12, 1e12, 1e11, 16 * GiB, 1e10),
)}


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ArgumentError(f"unknown target '{name}'; valid targets: {', '.join(TARGETS)}") from None


DEFAULT_TARGET = "mi355x"     # the compile target when none is named (k3c.compile, `k3c compile`, PassContext)


def target_for_properties(backend: str, arch: str, name: str = "", total_memory_bytes: int = 0,
                          shared_mem_optin: int = 0) -> Target:
    """The Target of a device from its properties (pure: launch.target_for feeds it torch's device properties).

    backend: cpu | cuda | hip; arch: "sm_90", "sm_100", "gfx950", ... (a ROCm gcnArchName such as
    "gfx942:sramecc+:xnack-" is accepted); name: the device name ("NVIDIA H200"); total_memory_bytes: its memory;
    shared_mem_optin: shared memory per block (opt-in), used only by a derived row.
    Among the rows of the device's arch (h100 and h200 are both sm_90): the one whose name the device name contains
    ("NVIDIA H200", "NVIDIA H200 MIG 1g.18gb" -> h200), else the one whose hbm_bytes is nearest the device's memory
    (an H100 reports about 79 GiB, an H200 about 140 GiB), else the first. An arch with no row gets a row derived
    from h100 / mi300x named cuda_<arch> / hip_<arch>, with the device's shared memory."""
    from .writer import name_part

    if backend == "cpu":
        return TARGETS["cpu"]
    if backend not in ("cuda", "hip"):
        raise ArgumentError(f"no target for device backend {backend!r} (cpu, cuda or hip)")
    arch = str(arch).split(":")[0].strip()
    rows = [t for t in TARGETS.values() if t.backend == backend and t.arch == arch]
    if rows:
        label = str(name or "").lower()
        named = [t for t in rows if t.name.lower() in label]
        if named:
            return max(named, key=lambda t: len(t.name))
        if total_memory_bytes and total_memory_bytes > 0:
            return min(rows, key=lambda t: abs(t.hbm_bytes - int(total_memory_bytes)))
        return rows[0]
    smem = int(shared_mem_optin or 0)
    if backend == "hip":
        base = TARGETS["mi300x"]
        return replace(base, name=f"hip_{name_part(arch)}", arch=arch, shared_mem_bytes=smem or base.shared_mem_bytes)
    return replace(TARGETS["h100"], name=f"cuda_{arch}", arch=arch, shared_mem_bytes=smem or 96 * KiB, tiers=(),
                   expert_layout="canonical")
