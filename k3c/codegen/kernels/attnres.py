"""Two-phase Block AttnRes kernels (K3.md section 4, paper Alg. 1); IR ops in k3c/ir/attnres_ops.py.

phase 1 (`attn_res_phase1`), two kernels:
    scores: one program per tile of BLOCK_M tokens; for each completed block b_i (its own pointer, unrolled) one
    sweep over the row tile computes sum(v^2) and the scores of all Q queries of the group at once (a
    [BLOCK_M, D] x [D, QP] dot; bf16 rows against the f32 queries split in hi + lo bf16 halves, so the scores are
    f32-accurate on tensor cores; fp32 sources use an ieee dot), scaled by 1/rms computed once per source row;
    online softmax statistics (m, l) across the blocks; raw scores and lse go to a small f32 scratch
    [M, N + 1, QP], lse also into the packed result.
    output: one program per (token row, BLOCK_D columns): reads each block's slice once and forms
    o_j = sum_i exp(s_ij - lse_j) v_i for all queries ([QP, BLOCK_D] accumulator), written as contiguous rows of
    the packed result [lse_j (f32 bits), pad, o_j].
phase 1, decode form (few token rows: M <= SPLIT_MAX_M; the form above would be cdiv(M, 64) = 1 program walking
all of D), two kernels, D split across programs, deterministic (no atomics: a fixed summation order):
    split scores: one program per (slice of BLOCK_DS columns, tile of BLOCK_M rows): for each block the partial
    dot products with all Q queries and the partial sum(v^2) of its slice, stored to an f32 workspace
    wd [M, N, NS, QP] and ws [M, N, NS] (NS = cdiv(D, BLOCK_DS) slices).
    split output: the output kernel above, which first sums the NS partials of its row in a fixed order (a
    [SB, QP] running tile, then one tree sum), finishes the scores (1/rms, online softmax, lse) exactly as the
    scores kernel does, writes lse into the packed result (column program 0 only) and forms o_j as above.
phase 2 (`attn_res_phase2`), one program per token row:
    p = p_old + y (rounded to the io dtype, written), s = q_j . p / rms(p), online-softmax merge with (o_j, lse_j),
    h rounded to the io dtype, then the next sublayer's RMSNorm; written once.
All math fp32; io in the sources' dtype.
"""
from __future__ import annotations

from ...ir.attnres_ops import STATS
from ..kernel import KernelSource
from ..targets import Target
from ..writer import CodegenError, SourceWriter, fnum, ident, name_part
from .common import (ELEM_BYTES, TL_DTYPE, check_dim, check_float, clamp, emit_math_helpers, interpreted, lanes,
                     pow2_ceil, pow2_floor, row_max_block, to_dtype)

MAX_SOURCES = 64
MAX_QUERIES = 256


def phase1_plan(d: int, q: int, elem_bytes: int, target: Target, block_m: int | None = None,
                block_d: int | None = None, num_warps: int | None = None) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_K, BLOCK_D, QP, num_warps).
    scores kernel: BLOCK_M = 64 token rows per program (the f32 queries are streamed from L2 once per tile),
    BLOCK_K = 64; output kernel: one token row x BLOCK_D columns per program, the [QP, BLOCK_D] fp32 accumulator
    held at ~128 registers per thread (BLOCK_D = 512 for QP = 32, 4 warps: 168 regs, no spills on sm_90;
    the fastest of the configs measured on the H200, docs/perf.md)."""
    qp = max(16, pow2_ceil(q))
    bm = block_m or (64 if target.shared_mem_bytes > 0 else 16)
    warps = num_warps or 4
    # columns sized for 32 lanes per warp (~128 accumulator registers per thread there); a 64-lane wave gets the
    # same BLOCK_D, i.e. half the accumulator per lane: at 128 per lane gfx950 spilled (185-246 VGPRs + spills)
    threads = min(lanes(target), 32) * warps
    bd = block_d or clamp(pow2_floor(max(1, 128 * threads // qp)), 16, 1024)
    bd = min(bd, max(16, pow2_ceil(d)))
    bk = min(64, max(16, pow2_ceil(d)))
    return bm, bk, bd, qp, warps


def _phase1_checks(hidden, num_sources, num_queries, eps, dtype):
    D = check_dim(hidden, "hidden")
    N = check_dim(num_sources, "num_sources")
    Q = check_dim(num_queries, "num_queries")
    if N > MAX_SOURCES or Q > MAX_QUERIES:
        raise CodegenError(f"attn_res_phase1: at most {MAX_SOURCES} sources and {MAX_QUERIES} queries")
    check_float(dtype)
    if ((STATS + D) * ELEM_BYTES[dtype]) % 4:
        raise CodegenError(f"attn_res_phase1: a packed row of {STATS + D} {dtype} is not a whole number of f32")
    if float(eps) < 0:
        raise CodegenError(f"eps must be >= 0, got {eps!r}")
    return D, N, Q


def _source_args(n: int, dtype: str) -> tuple[list[str], dict[str, str]]:
    """The phase-1 kernels' first args: one pointer per completed block (src0_ptr..src{n-1}_ptr), and the
    signature they start."""
    srcs = [f"src{i}_ptr" for i in range(n)]
    return srcs, {s: f"*{dtype}" for s in srcs}


def emit_attnres_phase1_scores(hidden: int, num_sources: int, num_queries: int, eps: float, *, target: Target,
                               dtype: str = "bf16", block_m: int | None = None, num_warps: int | None = None,
                               loc: str = "", interpret: bool | None = None) -> KernelSource:
    """Phase 1, kernel 1 of 2. Args: src0_ptr..src{N-1}_ptr [M, D], q_ptr [Q, D] f32, a_ptr [M, N + 1, QP] f32
    (scratch: raw scores s_ij, then lse_j in row N), lse_ptr (the packed result's storage as f32), M;
    grid (cdiv(M, BLOCK_M),). Each block row is read once for all Q queries; 1/rms once per source row."""
    D, N, Q = _phase1_checks(hidden, num_sources, num_queries, eps, dtype)
    e = ELEM_BYTES[dtype]
    interp = interpreted(target, interpret)
    bm, bk, _, qp, warps = phase1_plan(D, Q, e, target, block_m, None, num_warps)
    kname = ident(f"k3c_attnres_phase1_scores_fwd_d{D}_n{N}_q{Q}_{name_part(dtype)}_m{bm}_w{warps}")
    srcs, sig = _source_args(N, dtype)
    sig.update({"q_ptr": "*fp32", "a_ptr": "*fp32", "lse_ptr": "*fp32", "M": "i32"})
    constexprs = {"D": D, "Q": Q, "QP": qp, "BLOCK_M": bm, "BLOCK_K": bk}
    rowf = (STATS + D) * e // 4
    eps_lit = fnum(eps)
    w = SourceWriter()
    w.header(kernel=kname, ir_op="attn_res_phase1", loc=loc, target=target, emitter=__name__,
             notes=[f"phase 1 scores: N={N} blocks x Q={Q} queries, D={D}, eps={eps_lit}, io {dtype}, "
                    f"BLOCK_M={bm} BLOCK_K={bk} QP={qp} num_warps={warps}"
                    + (" [interpreter variant]" if interp else "")])
    w.imports()
    with w.jit_function(kname, list(sig), list(constexprs)):
        w.line("rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)")
        w.line("rmask = rows < M")
        w.line("rows64 = rows.to(tl.int64)")
        w.line("qc = tl.arange(0, QP)")
        w.line("qmask = qc < Q")
        w.line("m = tl.full([BLOCK_M, QP], float('-inf'), dtype=tl.float32)")
        w.line("l = tl.zeros([BLOCK_M, QP], dtype=tl.float32)")
        for i, s in enumerate(srcs):
            w.comment(f"block {i}: sum(v^2) and the scores of all queries in one sweep")
            w.line("acc = tl.zeros([BLOCK_M, QP], dtype=tl.float32)")
            w.line("ss = tl.zeros([BLOCK_M], dtype=tl.float32)")
            w.line("for k in range(0, D, BLOCK_K):")
            with w.indent():
                w.line("ks = k + tl.arange(0, BLOCK_K)")
                w.line("kmask = ks < D")
                w.line(f"vr = tl.load({s} + rows64[:, None] * D + ks[None, :], "
                       "mask=rmask[:, None] & kmask[None, :], other=0.0)")
                w.line("v = vr.to(tl.float32)")
                w.line("ss += tl.sum(v * v, axis=1)")
                w.line("qt = tl.load(q_ptr + qc[None, :] * D + ks[:, None], mask=kmask[:, None] & qmask[None, :], "
                       "other=0.0)")
                if interp:
                    w.line("acc += tl.dot(v, qt)")
                elif dtype == "fp32":
                    w.line("acc += tl.dot(v, qt, input_precision=\"ieee\")")
                else:
                    w.line("q_hi = qt.to(vr.dtype)")
                    w.line("q_lo = (qt - q_hi.to(tl.float32)).to(vr.dtype)")
                    w.line("acc = tl.dot(vr, q_hi, acc)")
                    w.line("acc = tl.dot(vr, q_lo, acc)")
            w.line(f"s = acc * tl.rsqrt(ss / D + {eps_lit})[:, None]")
            w.line(f"tl.store(a_ptr + (rows64[:, None] * {N + 1} + {i}) * QP + qc[None, :], s, mask=rmask[:, None])")
            w.line("m_new = tl.maximum(m, s)")
            w.line("l = l * tl.exp(m - m_new) + tl.exp(s - m_new)")
            w.line("m = m_new")
        w.line("lse = m + tl.log(l)")
        w.line(f"tl.store(a_ptr + (rows64[:, None] * {N + 1} + {N}) * QP + qc[None, :], lse, mask=rmask[:, None])")
        w.line(f"tl.store(lse_ptr + (qc[None, :].to(tl.int64) * M + rows64[:, None]) * {rowf}, lse, "
               "mask=rmask[:, None] & qmask[None, :])")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=constexprs,
                        grid=("cdiv(M, BLOCK_M)",), num_warps=warps, num_stages=1 if interp else 2,
                        ir_op="attn_res_phase1", loc=loc)


def _emit_row_tile(w: SourceWriter) -> None:
    """The phase-1 output programs' coordinates: packed row `row` (grid dim 0), its BLOCK_D columns (dim 1), the
    padded query index qc."""
    w.line("row = tl.program_id(0).to(tl.int64)")
    w.line("ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)")
    w.line("dmask = ds < D")
    w.line("qc = tl.arange(0, QP)")
    w.line("qmask = qc < Q")


def _emit_mix_store(w: SourceWriter, srcs: list[str], score, row: int, dtype: str, interp: bool) -> None:
    """Phase-1 output body shared by both forms: o_j = sum_i exp(score_i - lse) v_i over this program's BLOCK_D
    columns, stored after the STATS of packed row `row` (= STATS + D elements). score(i): the expression of source
    i's score row [QP]."""
    w.line("o = tl.zeros([QP, BLOCK_D], dtype=tl.float32)")
    for i, s in enumerate(srcs):
        w.line(f"a = tl.exp({score(i)} - lse)")
        w.line(f"v = tl.load({s} + row * D + ds, mask=dmask, other=0.0).to(tl.float32)")
        w.line("o += a[:, None] * v[None, :]")
    w.line(f"tl.store(out_ptr + (qc[:, None].to(tl.int64) * M + row) * {row} + {STATS} + ds[None, :], "
           f"{to_dtype('o', dtype, interp)}, mask=qmask[:, None] & dmask[None, :])")


def emit_attnres_phase1_out(hidden: int, num_sources: int, num_queries: int, *, target: Target,
                            dtype: str = "bf16", block_d: int | None = None, num_warps: int | None = None,
                            loc: str = "", interpret: bool | None = None) -> KernelSource:
    """Phase 1, kernel 2 of 2. Args: src0_ptr..src{N-1}_ptr [M, D], a_ptr (the scores kernel's scratch),
    out_ptr [Q, M, STATS + D], M; grid (M, cdiv(D, BLOCK_D)). o_j = sum_i exp(s_ij - lse_j) v_i for all queries
    from one read of each block's row slice; rows of o written contiguously."""
    D, N, Q = _phase1_checks(hidden, num_sources, num_queries, 0.0, dtype)
    e = ELEM_BYTES[dtype]
    interp = interpreted(target, interpret)
    _, _, bd, qp, warps = phase1_plan(D, Q, e, target, None, block_d, num_warps)
    kname = ident(f"k3c_attnres_phase1_out_fwd_d{D}_n{N}_q{Q}_{name_part(dtype)}_b{bd}_w{warps}")
    srcs, sig = _source_args(N, dtype)
    sig.update({"a_ptr": "*fp32", "out_ptr": f"*{dtype}", "M": "i32"})
    constexprs = {"D": D, "Q": Q, "QP": qp, "BLOCK_D": bd}
    row = STATS + D
    w = SourceWriter()
    w.header(kernel=kname, ir_op="attn_res_phase1", loc=loc, target=target, emitter=__name__,
             notes=[f"phase 1 output: N={N} blocks x Q={Q} queries, D={D}, io {dtype}, BLOCK_D={bd} QP={qp} "
                    f"num_warps={warps}" + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, rtne_bf16=interp and dtype == "bf16")
    with w.jit_function(kname, list(sig), list(constexprs)):
        _emit_row_tile(w)
        w.line(f"abase = row * {(N + 1)} * QP")
        w.line(f"lse = tl.load(a_ptr + abase + {N} * QP + qc)")
        _emit_mix_store(w, srcs, lambda i: f"tl.load(a_ptr + abase + {i} * QP + qc)", row, dtype, interp)
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=constexprs,
                        grid=("M", "cdiv(D, BLOCK_D)"), num_warps=warps, num_stages=1, ir_op="attn_res_phase1",
                        loc=loc)


def emit_attnres_phase1(hidden: int, num_sources: int, num_queries: int, eps: float, *, target: Target,
                        dtype: str = "bf16", block_m: int | None = None, block_d: int | None = None,
                        num_warps: int | None = None, scores_warps: int | None = None, loc: str = "",
                        interpret: bool | None = None) -> tuple[KernelSource, KernelSource]:
    """The two kernels of `attn_res_phase1`, launched in this order (see their docs)."""
    return (emit_attnres_phase1_scores(hidden, num_sources, num_queries, eps, target=target, dtype=dtype,
                                       block_m=block_m, num_warps=scores_warps, loc=loc, interpret=interpret),
            emit_attnres_phase1_out(hidden, num_sources, num_queries, target=target, dtype=dtype, block_d=block_d,
                                    num_warps=num_warps, loc=loc, interpret=interpret))


# -- phase 1, decode form: D split across programs ------------------------------------------------------------------
SPLIT_MAX_M = 64        # token rows up to which the runtime takes the split form (one 64-row tile or less)


def phase1_split_plan(d: int, q: int, elem_bytes: int, target: Target, block_m: int | None = None,
                      block_ds: int | None = None, block_d: int | None = None,
                      num_warps: int | None = None) -> tuple[int, int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_DS, BLOCK_K, NS, SB, BLOCK_D, QP) of the decode form.
    split scores: BLOCK_M = 16 rows (a dot tile; decode has 1-64 rows), BLOCK_DS columns per program chosen so
    that one row tile makes ~128 programs (d = 7168: 64 columns, NS = 112 slices, one BLOCK_K step per block);
    split output: the output kernel's BLOCK_D, partials summed SB slices at a time."""
    _, _, bd, qp, _ = phase1_plan(d, q, elem_bytes, target, None, block_d, num_warps)
    bm = block_m or 16
    ds = block_ds or clamp(pow2_ceil(-(-d // 128)), 16, 1024)
    ds = min(ds, max(16, pow2_ceil(d)))
    bk = min(64, ds)
    ns = -(-d // ds)
    sb = clamp(pow2_ceil(ns), 1, 32)
    return bm, ds, bk, ns, sb, bd, qp


def _plan_checks(bm: int, ds: int, bk: int) -> None:
    for v, what in ((bm, "block_m"), (ds, "block_ds")):
        if v < 16 or v & (v - 1):
            raise CodegenError(f"attn_res_phase1 split: {what} must be a power of two >= 16, got {v}")
    if ds % bk:
        raise CodegenError(f"attn_res_phase1 split: block_ds {ds} is not a multiple of BLOCK_K {bk}")


def emit_attnres_phase1_split_scores(hidden: int, num_sources: int, num_queries: int, *, target: Target,
                                     dtype: str = "bf16", block_m: int | None = None, block_ds: int | None = None,
                                     num_warps: int | None = None, loc: str = "",
                                     interpret: bool | None = None) -> KernelSource:
    """Phase 1 decode form, kernel 1 of 2. Args: src0_ptr..src{N-1}_ptr [M, D], q_ptr [Q, D] f32,
    wd_ptr [M, N, NS, QP] f32 (partial dots), ws_ptr [M, N, NS] f32 (partial sum(v^2)), M;
    grid (NS, cdiv(M, BLOCK_M)). The query slice is loaded (and split into bf16 hi + lo) once per BLOCK_K step for
    all N blocks; every workspace entry of rows < M is written exactly once."""
    D, N, Q = _phase1_checks(hidden, num_sources, num_queries, 0.0, dtype)
    e = ELEM_BYTES[dtype]
    interp = interpreted(target, interpret)
    bm, ds, bk, ns, _, _, qp = phase1_split_plan(D, Q, e, target, block_m, block_ds)
    _plan_checks(bm, ds, bk)
    warps = num_warps or 4
    kname = ident(f"k3c_attnres_phase1_split_scores_fwd_d{D}_n{N}_q{Q}_{name_part(dtype)}_m{bm}_s{ds}_w{warps}")
    srcs, sig = _source_args(N, dtype)
    sig.update({"q_ptr": "*fp32", "wd_ptr": "*fp32", "ws_ptr": "*fp32", "M": "i32"})
    constexprs = {"D": D, "Q": Q, "QP": qp, "NS": ns, "BLOCK_M": bm, "BLOCK_DS": ds, "BLOCK_K": bk}
    w = SourceWriter()
    w.header(kernel=kname, ir_op="attn_res_phase1", loc=loc, target=target, emitter=__name__,
             notes=[f"phase 1 split scores (decode form): N={N} blocks x Q={Q} queries, D={D} in NS={ns} slices of "
                    f"BLOCK_DS={ds}, io {dtype}, BLOCK_M={bm} BLOCK_K={bk} QP={qp} num_warps={warps}"
                    + (" [interpreter variant]" if interp else ""),
                    "partial dots and sum(v^2) per slice to the f32 workspace; no atomics (summed in a fixed "
                    "order by the split output kernel)"])
    w.imports()
    with w.jit_function(kname, list(sig), list(constexprs)):
        w.line("sl = tl.program_id(0)")
        w.line("rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)")
        w.line("rmask = rows < M")
        w.line("rows64 = rows.to(tl.int64)")
        w.line("qc = tl.arange(0, QP)")
        w.line("qmask = qc < Q")
        for i in range(N):
            w.line(f"acc{i} = tl.zeros([BLOCK_M, QP], dtype=tl.float32)")
            w.line(f"ss{i} = tl.zeros([BLOCK_M], dtype=tl.float32)")
        w.line("for k in range(0, BLOCK_DS, BLOCK_K):")
        with w.indent():
            w.line("ks = sl * BLOCK_DS + k + tl.arange(0, BLOCK_K)")
            w.line("kmask = ks < D")
            w.line("qt = tl.load(q_ptr + qc[None, :] * D + ks[:, None], mask=kmask[:, None] & qmask[None, :], "
                   "other=0.0)")
            bf = not interp and dtype != "fp32"
            if bf:
                w.line(f"q_hi = qt.to({TL_DTYPE[dtype]})")
                w.line(f"q_lo = (qt - q_hi.to(tl.float32)).to({TL_DTYPE[dtype]})")
            for i, s in enumerate(srcs):
                w.comment(f"block {i}: partial sum(v^2) and partial scores of all queries")
                w.line(f"vr = tl.load({s} + rows64[:, None] * D + ks[None, :], "
                       "mask=rmask[:, None] & kmask[None, :], other=0.0)")
                w.line("v = vr.to(tl.float32)")
                w.line(f"ss{i} += tl.sum(v * v, axis=1)")
                if interp:
                    w.line(f"acc{i} += tl.dot(v, qt)")
                elif dtype == "fp32":
                    w.line(f"acc{i} += tl.dot(v, qt, input_precision=\"ieee\")")
                else:
                    w.line(f"acc{i} = tl.dot(vr, q_hi, acc{i})")
                    w.line(f"acc{i} = tl.dot(vr, q_lo, acc{i})")
        for i in range(N):
            w.line(f"tl.store(wd_ptr + ((rows64[:, None] * {N} + {i}) * NS + sl) * QP + qc[None, :], acc{i}, "
                   "mask=rmask[:, None])")
            w.line(f"tl.store(ws_ptr + (rows64 * {N} + {i}) * NS + sl, ss{i}, mask=rmask)")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=constexprs,
                        grid=("NS", "cdiv(M, BLOCK_M)"), num_warps=warps, num_stages=1, ir_op="attn_res_phase1",
                        loc=loc)


def emit_attnres_phase1_split_out(hidden: int, num_sources: int, num_queries: int, eps: float, *, target: Target,
                                  dtype: str = "bf16", block_ds: int | None = None, block_d: int | None = None,
                                  num_warps: int | None = None, loc: str = "",
                                  interpret: bool | None = None) -> KernelSource:
    """Phase 1 decode form, kernel 2 of 2. Args: src0_ptr..src{N-1}_ptr [M, D], wd_ptr, ws_ptr (the split scores
    kernel's workspace), out_ptr [Q, M, STATS + D], lse_ptr (the same storage as f32), M;
    grid (M, cdiv(D, BLOCK_D)). Every program of a row sums that row's NS partials in the same fixed order, so all
    of them hold the same scores; column program 0 writes lse_j; then o_j as the output kernel forms it."""
    D, N, Q = _phase1_checks(hidden, num_sources, num_queries, eps, dtype)
    e = ELEM_BYTES[dtype]
    interp = interpreted(target, interpret)
    _, ds, bk, ns, sb, bd, qp = phase1_split_plan(D, Q, e, target, None, block_ds, block_d, num_warps)
    _plan_checks(16, ds, bk)
    warps = num_warps or 4
    kname = ident(f"k3c_attnres_phase1_split_out_fwd_d{D}_n{N}_q{Q}_{name_part(dtype)}_s{ds}_b{bd}_w{warps}")
    srcs, sig = _source_args(N, dtype)
    sig.update({"wd_ptr": "*fp32", "ws_ptr": "*fp32", "out_ptr": f"*{dtype}", "lse_ptr": "*fp32", "M": "i32"})
    constexprs = {"D": D, "Q": Q, "QP": qp, "NS": ns, "SB": sb, "BLOCK_D": bd}
    row = STATS + D
    rowf = row * e // 4
    eps_lit = fnum(eps)
    w = SourceWriter()
    w.header(kernel=kname, ir_op="attn_res_phase1", loc=loc, target=target, emitter=__name__,
             notes=[f"phase 1 split output (decode form): N={N} blocks x Q={Q} queries, D={D}, eps={eps_lit}, "
                    f"io {dtype}, NS={ns} partials summed {sb} at a time, BLOCK_D={bd} QP={qp} num_warps={warps}"
                    + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, rtne_bf16=interp and dtype == "bf16")
    with w.jit_function(kname, list(sig), list(constexprs)):
        _emit_row_tile(w)
        w.line("sc = tl.arange(0, SB)")
        w.line("m = tl.full([QP], float('-inf'), dtype=tl.float32)")
        w.line("l = tl.zeros([QP], dtype=tl.float32)")
        for i in range(N):
            w.comment(f"block {i}: the scores from the NS partials, summed in a fixed order")
            w.line("dacc = tl.zeros([SB, QP], dtype=tl.float32)")
            w.line("sacc = tl.zeros([SB], dtype=tl.float32)")
            w.line("for t0 in range(0, NS, SB):")
            with w.indent():
                w.line("sl = t0 + sc")
                w.line("smask = sl < NS")
                w.line(f"dacc += tl.load(wd_ptr + ((row * {N} + {i}) * NS + sl[:, None]) * QP + qc[None, :], "
                       "mask=smask[:, None], other=0.0)")
                w.line(f"sacc += tl.load(ws_ptr + (row * {N} + {i}) * NS + sl, mask=smask, other=0.0)")
            w.line(f"s{i} = tl.sum(dacc, axis=0) * tl.rsqrt(tl.sum(sacc, axis=0) / D + {eps_lit})")
            w.line(f"m_new = tl.maximum(m, s{i})")
            w.line(f"l = l * tl.exp(m - m_new) + tl.exp(s{i} - m_new)")
            w.line("m = m_new")
        w.line("lse = m + tl.log(l)")
        w.line("if tl.program_id(1) == 0:")
        with w.indent():
            w.line(f"tl.store(lse_ptr + (qc.to(tl.int64) * M + row) * {rowf}, lse, mask=qmask)")
        _emit_mix_store(w, srcs, lambda i: f"s{i}", row, dtype, interp)
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=constexprs,
                        grid=("M", "cdiv(D, BLOCK_D)"), num_warps=warps, num_stages=1, ir_op="attn_res_phase1",
                        loc=loc)


def emit_attnres_phase1_split(hidden: int, num_sources: int, num_queries: int, eps: float, *, target: Target,
                              dtype: str = "bf16", block_m: int | None = None, block_ds: int | None = None,
                              block_d: int | None = None, num_warps: int | None = None,
                              scores_warps: int | None = None, loc: str = "",
                              interpret: bool | None = None) -> tuple[KernelSource, KernelSource]:
    """The two kernels of the decode form of `attn_res_phase1`, launched in this order (see their docs); the
    workspace holds M * N * NS * (QP + 1) f32 (NS, QP: the first kernel's constexprs)."""
    return (emit_attnres_phase1_split_scores(hidden, num_sources, num_queries, target=target, dtype=dtype,
                                             block_m=block_m, block_ds=block_ds, num_warps=scores_warps, loc=loc,
                                             interpret=interpret),
            emit_attnres_phase1_split_out(hidden, num_sources, num_queries, eps, target=target, dtype=dtype,
                                          block_ds=block_ds, block_d=block_d, num_warps=num_warps, loc=loc,
                                          interpret=interpret))


PHASE2_MODES = ("none", "source", "update")


def emit_attnres_phase2(hidden: int, eps: float, *, mode: str, normed: bool, norm_eps: float | None,
                        target: Target, dtype: str = "bf16", weight_dtype: str | None = None,
                        num_warps: int | None = None, loc: str = "", interpret: bool | None = None) -> KernelSource:
    """Kernel args: s1_ptr [Q, M, STATS + D] (dtype), lse_ptr (same storage, f32), q_ptr [Q, D] f32,
    (p_ptr [M, D]), (y_ptr [M, D]), (w_ptr [D]), out_ptr ([2, M, D] for mode update: new partial, output;
    else [M, D]), qi (the query row), M; grid (M,)."""
    D = check_dim(hidden, "hidden")
    if mode not in PHASE2_MODES:
        raise CodegenError(f"attn_res_phase2 mode must be one of {PHASE2_MODES}, got {mode!r}")
    check_float(dtype)
    e = ELEM_BYTES[dtype]
    wdt = check_float(weight_dtype or dtype, "weight_dtype")
    if ((STATS + D) * e) % 4:
        raise CodegenError(f"attn_res_phase2: a packed row of {STATS + D} {dtype} is not a whole number of f32")
    if float(eps) < 0 or (normed and (norm_eps is None or float(norm_eps) < 0)):
        raise CodegenError("attn_res_phase2: eps and norm_eps must be >= 0")
    interp = interpreted(target, interpret)
    block = pow2_ceil(D)
    if block > row_max_block(target):
        raise CodegenError(f"attn_res_phase2: hidden size {D} exceeds the one-block row limit "
                           f"{row_max_block(target)} of target {target.name}")
    warps = num_warps or clamp(pow2_floor(max(1, block // (16 // e) // target.warp_size)), 1, 8)
    kname = ident(f"k3c_attnres_phase2_{mode}{'_norm' if normed else ''}_fwd_d{D}_{name_part(dtype)}_w{warps}")
    sig = {"s1_ptr": f"*{dtype}", "lse_ptr": "*fp32", "q_ptr": "*fp32"}
    if mode in ("source", "update"):
        sig["p_ptr"] = f"*{dtype}"
    if mode == "update":
        sig["y_ptr"] = f"*{dtype}"
    if normed:
        sig["w_ptr"] = f"*{wdt}"
    sig.update({"out_ptr": f"*{dtype}", "qi": "i32", "M": "i32"})
    constexprs = {"D": D, "BLOCK_D": block}
    row = STATS + D
    rowf = row * e // 4
    even = D == block
    mk = "" if even else ", mask=mask, other=0.0"
    sm = "" if even else ", mask=mask"

    w = SourceWriter()
    w.header(kernel=kname, ir_op="attn_res_phase2", loc=loc, target=target, emitter=__name__,
             notes=[f"phase 2: mode={mode} normed={normed} D={D} eps={fnum(eps)} io {dtype} BLOCK_D={block} "
                    f"num_warps={warps}" + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, rtne_bf16=interp and dtype == "bf16")
    with w.jit_function(kname, list(sig), list(constexprs)):
        w.line("row = tl.program_id(0).to(tl.int64)")
        w.line("cols = tl.arange(0, BLOCK_D)")
        if not even:
            w.line("mask = cols < D")
        w.line("srow = row + qi * M")
        w.line(f"o = tl.load(s1_ptr + srow * {row} + {STATS} + cols{mk}).to(tl.float32)")
        if mode == "none":
            w.line("h = o")
        else:
            w.line(f"lse = tl.load(lse_ptr + srow * {rowf})")
            if mode == "update":
                w.line(f"pa = tl.load(p_ptr + row * D + cols{mk}).to(tl.float32)")
                w.line(f"pb = tl.load(y_ptr + row * D + cols{mk}).to(tl.float32)")
                w.line(f"pn = {to_dtype('pa + pb', dtype, interp)}")
                w.line(f"tl.store(out_ptr + row * D + cols, pn{sm})")
                w.line("p = pn.to(tl.float32)")
            else:
                w.line(f"p = tl.load(p_ptr + row * D + cols{mk}).to(tl.float32)")
            w.line(f"q = tl.load(q_ptr + qi * D + cols{mk})")
            w.line(f"s = tl.sum(q * p, axis=0) * tl.rsqrt(tl.sum(p * p, axis=0) / D + {fnum(eps)})")
            w.line("mx = tl.maximum(lse, s)")
            w.line("w1 = tl.exp(lse - mx)")
            w.line("w2 = tl.exp(s - mx)")
            w.line(f"h = {to_dtype('(w1 * o + w2 * p) / (w1 + w2)', dtype, interp)}.to(tl.float32)")
        dst = "out_ptr + (row + M) * D + cols" if mode == "update" else "out_ptr + row * D + cols"
        if normed:
            w.line(f"g = tl.load(w_ptr + cols{mk}).to(tl.float32)")
            w.line(f"rstd = tl.rsqrt(tl.sum(h * h, axis=0) / D + {fnum(norm_eps)})")
            w.line("h = (h * rstd) * g")
        w.line(f"tl.store({dst}, {to_dtype('h', dtype, interp)}{sm})")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=constexprs, grid=("M",),
                        num_warps=warps, num_stages=1, ir_op="attn_res_phase2", loc=loc)


__all__ = ["emit_attnres_phase1", "emit_attnres_phase1_scores", "emit_attnres_phase1_out", "emit_attnres_phase1_split",
           "emit_attnres_phase1_split_scores", "emit_attnres_phase1_split_out", "emit_attnres_phase2", "phase1_plan",
           "phase1_split_plan", "SPLIT_MAX_M"]
