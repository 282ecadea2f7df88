"""Per-kernel resource usage read back from what triton produced: registers, shared memory (LDS), scratch/spills,
an occupancy estimate and the matrix instructions in the code.

Sources, per backend (all readable on a machine without the GPU; nothing here imports triton):
  hip:  the `amdgcn` text. The `.amdgpu_metadata` YAML block (`.vgpr_count`, `.sgpr_count`, `.agpr_count`,
        `.private_segment_fixed_size`, `.group_segment_fixed_size`, `.vgpr_spill_count`, `.sgpr_spill_count`) and the
        `; Kernel info` comments LLVM prints (`; NumVgprs`, `; ScratchSize`, `; Occupancy`, `; codeLenInByte`).
        Triton allocates LDS dynamically, so the LDS a launch needs is metadata `shared` + the static group segment.
  cuda: the `cubin` ELF. `.nv.info` carries EIATTR_REGCOUNT (registers/thread) and EIATTR_FRAME_SIZE (local memory
        per thread: spills and local arrays); `.nv.shared.<kernel>` is the static shared memory; metadata `shared` is
        the dynamic part. The ptxas `-v` log, when we have it, adds exact spill store/load bytes.
Matrix instructions are counted statically in the assembly text (amdgcn `v_mfma*`/`v_smfmac*`/`v_wmma*`, PTX
`wgmma.mma_async*`, `tcgen05.mma*`, `mma.sync*`): these say whether the kernel reached the tensor cores.

Occupancy model (an estimate; the hardware scheduler can do worse, never better):
  hip (CDNA3 gfx942 / CDNA4 gfx950): 4 SIMDs per CU, at most 8 waves per SIMD; 512 VGPRs per lane per SIMD shared by
      arch and acc VGPRs (granule 8); 800 SGPRs per SIMD (granule 16); LDS per CU 64 KiB (gfx942) / 160 KiB (gfx950).
      A workgroup of `num_warps` waves puts ceil(num_warps / 4) waves on each SIMD. Unit: waves per SIMD.
  cuda (sm_90 / sm_100): 65536 registers per SM, allocated per warp in units of 256 (regs/thread rounded up to a
      multiple of 8), at most 64 warps and 32 blocks per SM, 228 KiB shared memory per SM with 1 KiB reserved per
      block (allocation unit 128 B). Unit: warps per SM.
"""
from __future__ import annotations

import re
import struct
from dataclasses import asdict, dataclass, field

KiB = 1024


# ----------------------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class KernelResources:
    backend: str                       # hip | cuda
    arch: str                          # gfx950, sm_90, ...
    regs: int                          # AMD: total VGPRs/lane = arch (aligned to 4) + AGPRs, what limits occupancy;
                                       # NVIDIA: registers/thread
    vgpr: int | None = None            # AMD only: arch VGPRs
    sgpr: int | None = None
    agpr: int | None = None
    shared_bytes: int = 0              # per block / workgroup: static + dynamic (LDS on AMD)
    scratch_bytes: int = 0             # AMD private segment per lane; NVIDIA local-memory frame per thread
    spill_count: int = 0               # spills to memory: AMD VGPR spill count; NVIDIA spill store bytes (ptxas log)
    sgpr_lane_spills: int = 0          # AMD: SGPRs spilled into VGPR lanes (no memory traffic, not a spill above)
    occupancy: int = 0                 # estimate, in occupancy_unit
    occupancy_max: int = 0
    occupancy_unit: str = ""           # waves/SIMD | warps/SM
    occupancy_limiter: str = ""        # vgpr | sgpr | regs | lds | smem | waves | blocks
    compiler_occupancy: int | None = None   # LLVM's own `; Occupancy` (AMD; ignores dynamic LDS)
    code_bytes: int | None = None
    matrix_ops: dict[str, int] = field(default_factory=dict)   # mnemonic -> static count

    @property
    def has_spills(self) -> bool:
        return self.scratch_bytes > 0 or self.spill_count > 0

    def regs_text(self) -> str:
        if self.backend == "hip":
            text = f"{self.vgpr} V / {self.sgpr} S"
            return text + (f" / {self.agpr} A" if self.agpr else "")
        return f"{self.regs}"

    def occupancy_text(self) -> str:
        return f"{self.occupancy}/{self.occupancy_max} {self.occupancy_unit} ({self.occupancy_limiter})"

    def matrix_text(self) -> str:
        if not self.matrix_ops:
            return "-"
        return ", ".join(f"{name} x{count}" for name, count in sorted(self.matrix_ops.items()))

    def to_dict(self) -> dict:
        data = asdict(self)          # mnemonics sorted: a fresh compile and a cache hit write the same bytes
        data["matrix_ops"] = dict(sorted(self.matrix_ops.items()))
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "KernelResources":
        return cls(**data)


# --------------------------------------------------------------------------------------------------------- arch limits
@dataclass(frozen=True)
class AmdLimits:
    vgprs_per_simd_lane: int = 512     # unified arch + acc VGPR file (gfx90a and later)
    vgpr_granule: int = 8
    sgprs_per_simd: int = 800
    sgpr_granule: int = 16
    max_waves_per_simd: int = 8
    simds_per_cu: int = 4
    max_workgroups_per_cu: int = 32
    lds_per_cu: int = 64 * KiB


@dataclass(frozen=True)
class NvLimits:
    regs_per_sm: int = 65536
    reg_alloc_unit: int = 256          # registers, per warp
    max_regs_per_thread: int = 255
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    smem_per_sm: int = 228 * KiB
    smem_per_block: int = 227 * KiB
    smem_reserved_per_block: int = 1 * KiB
    smem_alloc_unit: int = 128


AMD_LIMITS: dict[str, AmdLimits] = {
    "gfx942": AmdLimits(lds_per_cu=64 * KiB),
    "gfx950": AmdLimits(lds_per_cu=160 * KiB),
}
NV_LIMITS: dict[str, NvLimits] = {
    "sm_90": NvLimits(),
    "sm_100": NvLimits(),
}


def _round_up(value: int, granule: int) -> int:
    return -(-value // granule) * granule


# --------------------------------------------------------------------------------------------------------- occupancy
def amd_occupancy(arch: str, *, vgpr: int, agpr: int = 0, sgpr: int = 0, lds_bytes: int = 0,
                  num_warps: int = 4, total_vgpr: int | None = None) -> tuple[int, int, str]:
    """(waves per SIMD, max waves per SIMD, limiter) for a kernel on a CDNA3/CDNA4 GPU. `vgpr` are arch VGPRs;
    total_vgpr (arch aligned to 4 + AGPRs, as LLVM reports it) is derived when not given."""
    lim = AMD_LIMITS.get(arch, AmdLimits())
    if total_vgpr is None:
        total_vgpr = _total_vgpr(vgpr, agpr)
    per_simd = max(1, -(-num_warps // lim.simds_per_cu))             # waves one workgroup puts on each SIMD
    limits = {"waves": lim.max_waves_per_simd}
    if total_vgpr > 0:
        limits["vgpr"] = lim.vgprs_per_simd_lane // _round_up(total_vgpr, lim.vgpr_granule)
    if sgpr > 0:
        limits["sgpr"] = lim.sgprs_per_simd // _round_up(sgpr, lim.sgpr_granule)
    # whole workgroups must fit: convert each per-SIMD wave limit to workgroups, then back to waves
    workgroups = {k: v // per_simd for k, v in limits.items()}
    workgroups["blocks"] = lim.max_workgroups_per_cu
    if lds_bytes > 0:
        workgroups["lds"] = lim.lds_per_cu // lds_bytes
    limiter = min(workgroups, key=lambda k: (workgroups[k], k != "waves"))
    return workgroups[limiter] * per_simd, lim.max_waves_per_simd, limiter


def nv_occupancy(arch: str, *, regs: int, shared_bytes: int = 0, num_warps: int = 4) -> tuple[int, int, str]:
    """(warps per SM, max warps per SM, limiter) for a kernel on sm_90 / sm_100 (CUDA occupancy calculator rules)."""
    lim = NV_LIMITS.get(arch, NvLimits())
    blocks = {"waves": lim.max_warps_per_sm // num_warps, "blocks": lim.max_blocks_per_sm}
    if regs > 0:
        regs_per_warp = _round_up(min(regs, lim.max_regs_per_thread) * 32, lim.reg_alloc_unit)
        blocks["regs"] = (lim.regs_per_sm // regs_per_warp) // num_warps
    if shared_bytes > 0:
        per_block = _round_up(shared_bytes + lim.smem_reserved_per_block, lim.smem_alloc_unit)
        blocks["smem"] = lim.smem_per_sm // per_block if shared_bytes <= lim.smem_per_block else 0
    limiter = min(blocks, key=lambda k: (blocks[k], k != "waves"))
    return blocks[limiter] * num_warps, lim.max_warps_per_sm, limiter


# ------------------------------------------------------------------------------------------------------ matrix ops
_AMD_MATRIX = re.compile(r"^(v_mfma\w*|v_smfmac\w*|v_wmma\w*|v_swmmac\w*)$")
_PTX_MATRIX = re.compile(r"^(wgmma\.mma_async\S*|tcgen05\.mma\S*|mma\.sync\S*|mma\.sp\S*)$")


def _asm_mnemonics(text: str, comment: str):
    for line in text.splitlines():
        line = line.split(comment, 1)[0].strip()
        if not line or line[0] in ".;/":
            continue
        if line.startswith("@"):                       # PTX predicate guard: @%p1 wgmma...
            parts = line.split(None, 1)
            if len(parts) < 2:
                continue
            line = parts[1]
        yield line.split(None, 1)[0].rstrip(";")


def amd_matrix_ops(amdgcn: str) -> dict[str, int]:
    """Static count of MFMA / WMMA instructions per mnemonic (incl. v_mfma_scale_f32_* MX instructions)."""
    counts: dict[str, int] = {}
    for mnemonic in _asm_mnemonics(amdgcn, ";"):
        if _AMD_MATRIX.match(mnemonic):
            counts[mnemonic] = counts.get(mnemonic, 0) + 1
    return counts


def ptx_matrix_ops(ptx: str) -> dict[str, int]:
    """Static count of wgmma (sm_90), tcgen05.mma (sm_100) and mma.sync instructions per full PTX opcode."""
    counts: dict[str, int] = {}
    for mnemonic in _asm_mnemonics(ptx, "//"):
        if _PTX_MATRIX.match(mnemonic):
            counts[mnemonic] = counts.get(mnemonic, 0) + 1
    return counts


# ---------------------------------------------------------------------------------------------------------- AMD
_YAML_FIELD = re.compile(r"^\s*(?:-\s+)?\.(\w+):\s+(\S+)\s*$")
_COMMENT_FIELD = re.compile(r"^;\s*(\w+)\s*[:=]\s*(\d+)")


def parse_amdgcn(amdgcn: str, kernel: str | None = None) -> dict[str, int]:
    """The numbers LLVM reports for one kernel in an amdgcn listing.

    Keys (when present): vgpr (arch VGPRs), agpr, total_vgpr (arch aligned to 4 + acc, what occupancy sees on
    gfx90a+), sgpr, private_segment, group_segment, vgpr_spills, sgpr_spills, scratch, occupancy, code_bytes.
    The `.amdgpu_metadata` YAML block (per kernel; its `.vgpr_count` is the total) is preferred; the
    `; Kernel info` comments (`; NumVgprs` = arch VGPRs, `; TotalNumVgprs`) fill the rest.
    """
    out: dict[str, int] = {}
    meta_start = amdgcn.find(".amdgpu_metadata")
    if meta_start >= 0:
        block = amdgcn[meta_start:amdgcn.find(".end_amdgpu_metadata", meta_start)]
        # one `- .agpr_count:` list item per kernel; pick the one whose .name matches (or the first)
        items = re.split(r"\n\s*-\s+(?=\.agpr_count|\.args|\.name)", block)
        chosen = None
        for item in items:
            fields = {}
            for line in item.splitlines():
                m = _YAML_FIELD.match(line)
                if m:
                    fields.setdefault(m.group(1), m.group(2))
            if "vgpr_count" not in fields:
                continue
            if chosen is None or (kernel and fields.get("name") == kernel):
                chosen = fields
        names = {"vgpr_count": "total_vgpr", "sgpr_count": "sgpr", "agpr_count": "agpr",
                 "private_segment_fixed_size": "private_segment", "group_segment_fixed_size": "group_segment",
                 "vgpr_spill_count": "vgpr_spills", "sgpr_spill_count": "sgpr_spills"}
        for key, name in names.items():
            if chosen and key in chosen and chosen[key].isdigit():
                out[name] = int(chosen[key])
    comments: dict[str, int] = {}
    for line in amdgcn.splitlines():
        if line.startswith(";"):
            m = _COMMENT_FIELD.match(line)
            if m:
                comments.setdefault(m.group(1), int(m.group(2)))    # first kernel's block
    for key, name in (("NumVgprs", "vgpr"), ("TotalNumVgprs", "total_vgpr"), ("TotalNumSgprs", "sgpr"),
                      ("NumAgprs", "agpr"), ("ScratchSize", "scratch"), ("Occupancy", "occupancy"),
                      ("codeLenInByte", "code_bytes")):
        if key in comments:
            out.setdefault(name, comments[key])
    if "vgpr" not in out and "total_vgpr" in out:
        out["vgpr"] = out["total_vgpr"] - out.get("agpr", 0) if out.get("agpr") else out["total_vgpr"]
    if "total_vgpr" not in out and "vgpr" in out:
        out["total_vgpr"] = _total_vgpr(out["vgpr"], out.get("agpr", 0))
    if "scratch" not in out and "private_segment" in out:
        out["scratch"] = out["private_segment"]
    return out


def _total_vgpr(vgpr: int, agpr: int) -> int:
    """LLVM getTotalNumVGPRs for gfx90a+: arch VGPRs aligned to 4, then the AGPRs, when AGPRs are used."""
    return _round_up(vgpr, 4) + agpr if agpr else vgpr


def amd_resources(arch: str, amdgcn: str, *, shared: int = 0, num_warps: int = 4,
                  kernel: str | None = None) -> KernelResources:
    info = parse_amdgcn(amdgcn, kernel)
    vgpr, sgpr, agpr = info.get("vgpr", 0), info.get("sgpr", 0), info.get("agpr", 0)
    total = info.get("total_vgpr", _total_vgpr(vgpr, agpr))
    lds = shared + info.get("group_segment", 0)
    occ, occ_max, limiter = amd_occupancy(arch, vgpr=vgpr, agpr=agpr, sgpr=sgpr, lds_bytes=lds,
                                          num_warps=num_warps, total_vgpr=total)
    return KernelResources(
        backend="hip", arch=arch, regs=total, vgpr=vgpr, sgpr=sgpr, agpr=agpr, shared_bytes=lds,
        scratch_bytes=max(info.get("scratch", 0), info.get("private_segment", 0)),
        spill_count=info.get("vgpr_spills", 0), sgpr_lane_spills=info.get("sgpr_spills", 0),
        occupancy=occ, occupancy_max=occ_max, occupancy_unit="waves/SIMD", occupancy_limiter=limiter,
        compiler_occupancy=info.get("occupancy"), code_bytes=info.get("code_bytes"),
        matrix_ops=amd_matrix_ops(amdgcn))


# ------------------------------------------------------------------------------------------------------- NVIDIA
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_MAX_STACK_SIZE = 0x23
EIATTR_REGCOUNT = 0x2F
_EIFMT_SVAL = 0x04                       # u16 size, then payload
_EIFMT_HVAL = 0x03                       # u16 value
_EIFMT_BVAL = 0x02                       # u8 value
_EIFMT_NVAL = 0x01                       # no value


def _elf_sections(data: bytes) -> dict[str, tuple[int, int]]:
    """name -> (offset, size) of each section of a 64-bit little-endian ELF."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    str_off = headers[shstrndx][4]
    out = {}
    for name_off, _type, _flags, _addr, offset, size, *_rest in headers:
        end = data.index(b"\0", str_off + name_off)
        out[data[str_off + name_off:end].decode(errors="replace")] = (offset, size)   # NOBITS: size, no data
    return out


def _elf_symbols(data: bytes, sections: dict[str, tuple[int, int]]) -> dict[int, str]:
    if ".symtab" not in sections or ".strtab" not in sections:
        return {}
    sym_off, sym_size = sections[".symtab"]
    str_off, _ = sections[".strtab"]
    out = {}
    for i in range(sym_size // 24):
        (name_off,) = struct.unpack_from("<I", data, sym_off + 24 * i)
        end = data.index(b"\0", str_off + name_off)
        out[i] = data[str_off + name_off:end].decode(errors="replace")
    return out


def parse_cubin(cubin: bytes, kernel: str) -> dict[str, int]:
    """regs (registers/thread), frame_bytes (local memory per thread), max_stack, static_shared for `kernel`."""
    sections = _elf_sections(cubin)
    symbols = _elf_symbols(cubin, sections)
    out: dict[str, int] = {}
    if ".nv.info" in sections:
        offset, size = sections[".nv.info"]
        pos, end = offset, offset + size
        attrs: dict[tuple[int, str], int] = {}
        while pos + 2 <= end:
            fmt, attr = cubin[pos], cubin[pos + 1]
            if fmt == _EIFMT_SVAL:
                (length,) = struct.unpack_from("<H", cubin, pos + 2)
                if length == 8:
                    sym, value = struct.unpack_from("<II", cubin, pos + 4)
                    attrs[(attr, symbols.get(sym, str(sym)))] = value
                pos += 4 + length
            elif fmt in (_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL):
                pos += 4                                 # fmt, attr, 2 bytes of value or padding
            else:
                break                                    # unknown record format: stop rather than misread
        for attr, name in ((EIATTR_REGCOUNT, "regs"), (EIATTR_FRAME_SIZE, "frame_bytes"),
                           (EIATTR_MAX_STACK_SIZE, "max_stack"), (EIATTR_MIN_STACK_SIZE, "min_stack")):
            if (attr, kernel) in attrs:
                out[name] = attrs[(attr, kernel)]
    shared = sections.get(f".nv.shared.{kernel}")
    out["static_shared"] = shared[1] if shared else 0
    return out


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str) -> dict[str, int]:
    """`ptxas -v` output (triton runs ptxas with -v; TRITON_DUMP_PTXAS_LOG=1 prints it)."""
    out: dict[str, int] = {}
    m = _PTXAS_REGS.search(log)
    if m:
        out["regs"] = int(m.group(1))
    m = _PTXAS_SPILLS.search(log)
    if m:
        out["frame_bytes"], out["spill_stores"], out["spill_loads"] = map(int, m.groups())
    return out


def nv_resources(arch: str, cubin: bytes, ptx: str, *, kernel: str, shared: int = 0, num_warps: int = 4,
                 ptxas_log: str | None = None) -> KernelResources:
    info = parse_cubin(cubin, kernel)
    log = parse_ptxas_log(ptxas_log) if ptxas_log else {}
    regs = info.get("regs", log.get("regs", 0))
    smem = shared + info.get("static_shared", 0)
    occ, occ_max, limiter = nv_occupancy(arch, regs=regs, shared_bytes=smem, num_warps=num_warps)
    return KernelResources(
        backend="cuda", arch=arch, regs=regs, shared_bytes=smem,
        scratch_bytes=max(info.get("frame_bytes", 0), log.get("frame_bytes", 0)),
        spill_count=log.get("spill_stores", 0),
        occupancy=occ, occupancy_max=occ_max, occupancy_unit="warps/SM", occupancy_limiter=limiter,
        matrix_ops=ptx_matrix_ops(ptx))


def kernel_resources(backend: str, arch: str, asm: dict, *, kernel: str, shared: int = 0, num_warps: int = 4,
                     ptxas_log: str | None = None) -> KernelResources:
    """Resources from triton's `compiled.asm`-like dict (amdgcn text, or cubin bytes + ptx text)."""
    if backend == "hip":
        return amd_resources(arch, asm["amdgcn"], shared=shared, num_warps=num_warps, kernel=kernel)
    if backend == "cuda":
        return nv_resources(arch, asm["cubin"], asm.get("ptx", ""), kernel=kernel, shared=shared,
                            num_warps=num_warps, ptxas_log=ptxas_log)
    raise ValueError(f"no resource parser for backend '{backend}'")
