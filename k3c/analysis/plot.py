"""`k3c plan --plot FILE.png`: per-GPU memory breakdown and a roofline chart with the predicted per-kind points
(and measured benchmark points). Uses matplotlib's Agg canvas directly (no pyplot, no global backend change).
matplotlib is an optional dependency: `pip install k3c[plot]`.
"""
from __future__ import annotations

import io

from ..errors import ArgumentError
from ..outputs import write_file
from .formulas import GB
from .roofline import phase_points, roofline_flops_per_s

KIND_COLORS = {"kda": "#1f77b4", "mla": "#d62728", "moe": "#2ca02c", "mlp": "#9467bd", "attn_res": "#ff7f0e",
               "other": "#7f7f7f"}
PHASE_MARKERS = {"prefill": "o", "decode": "s", "append-prefill": "^"}
MEMORY_COLORS = ("#2ca02c", "#98df8a", "#d62728", "#1f77b4", "#aec7e8", "#ff7f0e", "#7f7f7f", "#9467bd")


def plot_plan(plan, path: str, overwrite: bool = False) -> None:
    """The chart as a PNG at `path` (k3c/outputs.py's file policy: an existing file only with `overwrite`)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ArgumentError("--plot needs matplotlib: pip install 'k3c[plot]'") from None
    fig = Figure(figsize=(13, 5.2), dpi=80)
    FigureCanvasAgg(fig)
    ax_mem, ax_roof = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    _memory(ax_mem, plan)
    _roofline(ax_roof, plan)
    t, lay, cfg = plan.target, plan.layout, plan.config
    fig.suptitle(f"k3c plan: {plan.model} on {t.name}, TP {lay.tp} x EP {lay.ep}, context {cfg.context:,}, "
                 f"batch {cfg.batch}, MLA cache {cfg.kv_dtype}", fontsize=11)
    fig.subplots_adjust(left=0.06, right=0.985, bottom=0.11, top=0.86, wspace=0.22)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_file(path, buf.getvalue(), overwrite, what="--plot")


def _memory(ax, plan) -> None:
    """Stacked bars: the planned batch, and the largest batch that fits at this context."""
    import dataclasses

    bars = [(f"batch {plan.config.batch}", plan.memory)]
    best = plan.fit["max_batch_at_context"]
    if best and best != plan.config.batch:
        cfg = dataclasses.replace(plan.config, batch=best)
        bars.append((f"batch {best} (max)", plan.planner.plan(cfg)))
    routed = plan.weights.by_category.get("routed experts", {}).get("gpu_bytes", 0.0)
    for x, (label, mem) in enumerate(bars):
        parts = [("routed experts", routed), ("other weights", mem.weights_bytes - routed),
                 ("MLA latent cache", mem.mla_kv_cache_bytes), ("KDA state", mem.kda_state_bytes),
                 ("conv tails", mem.conv_state_bytes), ("AttnRes blocks", mem.attnres_bytes),
                 ("workspace", mem.workspace_bytes)]
        if mem.kda_checkpoint_bytes:
            parts.append(("KDA prefix checkpoints", mem.kda_checkpoint_bytes))
        bottom = 0.0
        for (name, value), color in zip(parts, MEMORY_COLORS):
            ax.bar([x], [value / GB], bottom=[bottom / GB], color=color, width=0.55,
                   label=f"{name}: {value / GB:,.2f} GB" if x == 0 else None)
            bottom += value
        top = plan.memory.hbm_bytes * 1.1               # the y limit: a label far above it overflows the raster
        ax.text(x, min(bottom, top * 0.95) / GB, f"{bottom / GB:,.1f} GB" + (" (off scale)" if bottom > top else ""),
                ha="center", va="bottom", fontsize=8)
    mem = plan.memory
    ax.axhline(mem.hbm_bytes / GB, color="black", lw=1.2)
    right = len(bars) + 1.25
    ax.text(right, mem.hbm_bytes / GB, f"HBM {mem.hbm_bytes / GB:,.0f} GB", va="bottom", ha="right", fontsize=8)
    ax.axhline(mem.usable_bytes / GB, color="black", lw=1, ls="--")
    ax.text(right, mem.usable_bytes / GB, f"usable ({plan.config.headroom:.0%} headroom)", va="top", ha="right",
            fontsize=8)
    ax.set_xlim(-0.5, len(bars) + 1.3)
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([label for label, _ in bars])
    ax.set_ylabel("GB per GPU (1e9 bytes)")
    ax.set_ylim(0, mem.hbm_bytes / GB * 1.1)
    ax.set_title(f"Memory per GPU at context {plan.config.context:,}", fontsize=10)
    ax.legend(loc="center right", fontsize=8, frameon=False, title=f"batch {plan.config.batch}", title_fontsize=8)


def _log_ticks(axis) -> None:
    """Plain 1eN tick labels (no mathtext: faster, and nothing to typeset)."""
    import math

    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"1e{round(math.log10(v))}" if v > 0 else ""))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _roofline(ax, plan) -> None:
    t = plan.target
    peaks = plan.cost_model.peaks
    bw = t.hbm_bytes_per_s
    points = phase_points(plan.phases)
    xs = [p.intensity for p in points + plan.measured]
    lo = min([0.1] + [x / 3 for x in xs])
    hi = max([1e4] + [x * 3 for x in xs])
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.loglog(grid, [roofline_flops_per_s(x, peaks["bf16"], bw) for x in grid], color="black", lw=1.5,
              label=f"bf16 roof ({peaks['bf16'] / 1e15:g} PFLOP/s, {bw / 1e12:g} TB/s)")
    if peaks["expert"] != peaks["bf16"]:
        ax.loglog(grid, [roofline_flops_per_s(x, peaks["expert"], bw) for x in grid], color="black", lw=1,
                  ls="--", label=f"expert GEMM roof ({peaks['expert'] / 1e15:g} PFLOP/s)")
    for p in points:
        phase, _, kind = p.name.rpartition(" ")
        ax.loglog([p.intensity], [p.flops_per_s], marker=PHASE_MARKERS.get(phase, "o"), ls="none", ms=7,
                  color=KIND_COLORS.get(kind, "#333333"), alpha=0.85)
    for p in plan.measured:
        ax.loglog([p.intensity], [p.flops_per_s], marker="x", ls="none", ms=8, mew=2, color="black")
        ax.annotate(p.name, (p.intensity, p.flops_per_s), fontsize=7, xytext=(4, -8), textcoords="offset points")
    # legend: kinds by colour, phases by marker
    for kind, color in KIND_COLORS.items():
        if any(p.name.endswith(" " + kind) for p in points):
            ax.plot([], [], color=color, marker="o", ls="none", label=kind)
    for phase, marker in PHASE_MARKERS.items():
        ax.plot([], [], color="#555555", marker=marker, ls="none", label=phase)
    if plan.measured:
        ax.plot([], [], color="black", marker="x", ls="none", label="measured")
    _log_ticks(ax.xaxis)
    _log_ticks(ax.yaxis)
    ax.set_xlabel("arithmetic intensity (FLOP / HBM byte)")
    ax.set_ylabel("FLOP/s per GPU")
    ax.set_title("Roofline: predicted time per layer kind and phase", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right", ncol=2, frameon=False)
