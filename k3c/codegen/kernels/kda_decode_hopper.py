"""KDA's fused decode step on the Hopper tier (Gluon, sm_90a): the portable `emit_kda_decode`'s contract (same
arguments, grid (B * H,), outputs, conv tails updated in place), with the layout of the state chosen by hand.

Why a tier kernel: the step is a stream of the fp32 state (8 D^2 bytes per head and token, read and written), and
each V slice of the state needs two reductions over K (k^T S and q^T S). Plain Triton lays a [D, BV] slice out with
its warps along K, so both reductions and the q / k vectors' layout changes go through shared memory with a barrier
each: the sm_90 SASS of the portable kernel has 42 BAR.SYNC for 4 slices, and at 159 registers three heads share an
SM, which left the step at 57-78% of copy bandwidth on the H200 (docs/perf.md, KDA). Here the 32 lanes of a warp
run along K (D / 32 rows each) and the warps along V: every reduction over K is a warp's shuffle, the [D] vectors
(q, k, the decay) are each warp's own replica; the cross-warp steps (the head's conv, norms and layout changes in a
flat layout, the output RMSNorm's sum) happen once per head, outside the slice loop. The next slice's state load is issued before the current slice's update, as in the portable kernel.
"""
from __future__ import annotations

from dataclasses import replace

from ..kernel import KernelSource
from ..targets import Target
from ..tiers import tier_of
from ..writer import CodegenError, SourceWriter, fnum, ident, name_part
from .common import check_dim, check_float
from .kda import KDAPlan, _check_gate, _check_pow2, decode_signature, emit_kda_decode, kda_plan

HOPPER_ARCH = "sm_90"


def hopper_decode_supported(head_dim: int, block_v: int, warps: int, target: Target) -> bool:
    """Whether this kernel serves the shape: an sm_90 target with the hopper tier, D a power of two >= 32 (32
    lanes along K), BV a power of two dividing D, at least one column per warp."""
    return (target.backend == "cuda" and target.arch == HOPPER_ARCH and target.has_tier("hopper")
            and head_dim >= 32 and head_dim & (head_dim - 1) == 0 and block_v >= warps
            and block_v & (block_v - 1) == 0 and head_dim % block_v == 0 and warps & (warps - 1) == 0)


def gl_module_head(w: SourceWriter) -> None:
    """The imports of a KDA tier module and its _sigmoid helper (gl_gate's safe gate and the kernels call it)."""
    w.gluon_imports()
    w.blank()
    w.blank()
    w.line("@gluon.jit")
    w.line("def _sigmoid(x):")
    w.line("    return 1.0 / (1.0 + gl.exp(-x))")


def gl_gate(gate: str, lb: float, x: str, a: str, out: str) -> str:
    if gate == "softplus":
        return f"{out} = -{a} * gl.where({x} > 20.0, {x}, gl.log(1.0 + gl.exp(gl.minimum({x}, 20.0))))"
    return f"{out} = {fnum(lb)} * _sigmoid({a} * {x})"


def gl_cast(expr: str, dtype: str) -> str:
    return f"({expr}).to({'gl.float32' if dtype == 'fp32' else {'bf16': 'gl.bfloat16', 'fp16': 'gl.float16'}[dtype]})"


def gl_round(expr: str, dtype: str) -> str:
    return expr if dtype == "fp32" else f"{gl_cast(expr, dtype)}.to(gl.float32)"


def emit_kda_decode_hopper(num_heads: int, head_dim: int, conv_kernel: int, *, gate: str, gate_lower_bound: float,
                           l2norm_eps: float, norm_eps: float, target: Target, dtype: str = "bf16",
                           scale: float | None = None, plan: KDAPlan | None = None, fuse_out: bool = True,
                           ir_op: str = "kda_decode", loc: str = "") -> KernelSource:
    """The portable emit_kda_decode's arguments and outputs (looped layout: one program per (b, h) walks the V
    slices of BV = plan.decode_block_v columns with plan.decode_warps warps)."""
    H, D, KW = check_dim(num_heads, "num_heads"), _check_pow2(head_dim, "head_dim"), check_dim(conv_kernel, "conv")
    if KW < 2:
        raise CodegenError(f"conv_kernel must be >= 2, got {KW}")
    check_float(dtype)
    _check_gate(gate, gate_lower_bound)
    p = plan or kda_plan(D, dtype, target)
    BV, NW = min(p.decode_block_v, D), p.decode_warps
    if not hopper_decode_supported(D, BV, NW, target):
        raise CodegenError(f"hopper KDA decode: needs an sm_90 cuda target with the hopper tier, head_dim a power of "
                           f"two >= 32, block_v a power of two dividing it with a column per warp (warps a power of "
                           f"two); got {target.name} ({target.backend} {target.arch}) D={D} BV={BV} warps={NW}")
    scale = D ** -0.5 if scale is None else float(scale)
    NS, HD = D // BV, H * D
    # lanes along K (plan.decode_lanes_k): 8 make a reduction over K D / 8 adds in a thread and three shuffles per
    # column; 32 make it five shuffles per column for more columns a thread, at fewer registers
    TK = p.decode_lanes_k
    if BV < (32 // TK) * NW:
        raise CodegenError(f"hopper KDA decode: block_v {BV} is narrower than the {32 // TK} lanes x {NW} warps "
                           f"along V")
    ydt = dtype if fuse_out else "fp32"
    kname = ident(f"k3c_kda_decode_hopper_h{H}_d{D}_k{KW}_{gate}_{name_part(dtype)}_bv{BV}_w{NW}_lk{TK}"
                  + ("" if fuse_out else "_noout"))
    sig = decode_signature(dtype, fuse_out)
    const = {"H": H, "D": D, "KW": KW, "BV": BV}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"kda fused decode, Hopper tier (Gluon, sm_90a): H={H} D={D} conv={KW} gate={gate} x:{dtype} "
                    f"BV={BV} warps={NW} (lanes along K, warps along V) output norm x gate fused: {fuse_out}"])
    gl_module_head(w)
    with w.gluon_function(kname, sig, const):
        w.lines([
            f"SL: gl.constexpr = gl.BlockedLayout([D // {TK}, BV // {(32 // TK) * NW}], [{TK}, {32 // TK}], [1, {NW}], "
            "[1, 0])",
            "KV: gl.constexpr = gl.SliceLayout(1, SL)",
            "VV: gl.constexpr = gl.SliceLayout(0, SL)",
            f"FLAT: gl.constexpr = gl.BlockedLayout([{max(1, D // (32 * NW))}], [32], [{NW}], [0])",
            "VS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])",
            "pid = gl.program_id(0)",
            "b = (pid // H).to(gl.int64)",
            "h = pid % H",
            "rk = gl.arange(0, D, layout=KV)",
            "rv = gl.arange(0, BV, layout=VV)",
            "s_base = pid.to(gl.int64) * D * D + rk[:, None].to(gl.int64) * D",
            "S_next = gl.load(s_in + s_base + rv[None, :])       # the first slice streams in during the prep",
            "rf = gl.arange(0, D, layout=FLAT)",
            "col = h * D + rf",
            f"xo = b * {HD} + col",
            "tb = xo * (KW - 1)",
        ])
        _emit_head_inputs(w, HD, KW, dtype, gate, gate_lower_bound, l2norm_eps, scale)
        _emit_slices(w, NS, BV, HD, fuse_out, norm_eps, ydt)
    tier = tier_of("hopper")
    ks = KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=const, grid=("B * H",),
                      num_warps=NW, num_stages=1, ir_op=ir_op, loc=loc)
    return replace(ks, tier=tier.name, builds_with=tier.builds_with)


def decode_kernel(num_heads: int, head_dim: int, conv_kernel: int, *, plan: KDAPlan, interpret: bool | None = None,
                  **kw) -> KernelSource:
    """The decode step's kernel of `plan`'s tier (the one place the runtime and the catalogue choose it)."""
    if plan.decode_tier == "hopper":
        if interpret:
            raise CodegenError("the hopper KDA decode is a Gluon kernel: the interpreter cannot run it")
        return emit_kda_decode_hopper(num_heads, head_dim, conv_kernel, plan=plan, **kw)
    return emit_kda_decode(num_heads, head_dim, conv_kernel, plan=plan, interpret=interpret, **kw)


def _emit_head_inputs(w: SourceWriter, HD: int, KW: int, dtype: str, gate: str, lb: float, l2norm_eps: float,
                      scale: float) -> None:
    """q, k (conv, SiLU, L2 norm; q scaled), v, the decay and beta of the program's head, in the slices' layouts
    (v through shared memory: v_sh); the conv tails written in place once every read is done."""
    pending: list[tuple[str, str]] = []          # (tail out pointer expression, value): written after every read
    # the head's q, k, v convs, norms and decay over all D columns in one flat layout (an element a thread,
    # replicated only when D < the threads), then into the slices' layouts
    for x, wt, tin, tout, name in (("xq", "wq", "tq_in", "tq_out", "qf"), ("xk", "wk", "tk_in", "tk_out", "kf"),
                                   ("xv", "wv", "tv_in", "tv_out", "vf")):
        tag = name[0]
        w.lines([f"c{tag} = gl.load({x} + xo)",
                 f"acc = c{tag}.to(gl.float32) * gl.load({wt} + col * KW + KW - 1).to(gl.float32)"])
        for j in range(KW - 1):
            w.lines([f"t{tag}_{j} = gl.load({tin} + tb + {j})",
                     f"acc += t{tag}_{j}.to(gl.float32) * gl.load({wt} + col * KW + {j}).to(gl.float32)"])
        for j in range(KW - 2):
            pending.append((f"{tout} + tb + {j}", f"t{tag}_{j + 1}"))
        pending.append((f"{tout} + tb + {KW - 2}", f"c{tag}"))
        w.line(f"acc = {gl_round('acc', dtype)}")
        w.line(f"{name} = {gl_round('acc * _sigmoid(acc)', dtype)}")
        if tag != "v":
            w.line(f"{name} = {name} / gl.sqrt(gl.sum({name} * {name}, axis=0) + {fnum(l2norm_eps)})")
    w.lines([
        "f = gl.load(xf + xo).to(gl.float32) + gl.load(dt_bias + col)",
        "a = gl.exp(gl.load(a_log + h))",
        gl_gate(gate, lb, "f", "a", "gk"),
        "beta = _sigmoid(gl.load(xb + b * H + h).to(gl.float32))",
        f"qv = gl.convert_layout(qf * {fnum(scale)}, KV)",
        "kv = gl.convert_layout(kf, KV)",
        "eg = gl.convert_layout(gl.exp(gk), KV)[:, None]",
        "v_sh = gl.allocate_shared_memory(gl.float32, [D], VS, vf)",
    ])
    # the tails update in place: a replicated element is read by one thread and written by another, so every
    # read of the program comes before the first write (the barrier also publishes v_sh)
    w.line("gl.barrier()")
    for ptr, val in pending:
        w.line(f"gl.store({ptr}, {val})")


def _emit_slices(w: SourceWriter, NS: int, BV: int, HD: int, fuse_out: bool, norm_eps: float, ydt: str) -> None:
    """The state update slice by slice (the next slice's load in flight), then o (or the fused y) out."""
    for j in range(NS):
        w.line("S = S_next")
        if j + 1 < NS:
            w.line(f"S_next = gl.load(s_in + s_base + ({(j + 1) * BV} + rv)[None, :])   # next slice in flight")
        w.lines([
            f"vv = v_sh.slice({j * BV}, BV).load(VV)",
            "S = S * eg",
            "u = beta * (vv - gl.sum(kv[:, None] * S, axis=0))",
            "S = S + kv[:, None] * u[None, :]",
            f"o{j} = gl.sum(qv[:, None] * S, axis=0)",
            f"gl.store(s_out + s_base + ({j * BV} + rv)[None, :], S)",
        ])
    w.line(f"yb = b * {HD} + h * D")
    if fuse_out:
        w.line("ss = " + " + ".join(f"gl.sum(o{j} * o{j}, axis=0)" for j in range(NS)))
        w.line(f"rinv = gl.rsqrt(ss / D + {fnum(norm_eps)})")
        for j in range(NS):
            w.line(f"o{j} = o{j} * rinv * gl.load(nw + {j * BV} + rv) * "
                   f"_sigmoid(gl.load(xg + yb + {j * BV} + rv).to(gl.float32))")
    for j in range(NS):
        w.line(f"gl.store(y + yb + {j * BV} + rv, {gl_cast(f'o{j}', ydt)})")
