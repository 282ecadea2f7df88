"""Analyses over the lowered IR: memory planner, cost model and roofline (`k3c plan`, docs/plan.md).

    from k3c.analysis import plan
    p = plan("examples/kimi-k3.yaml", "mi355x", tp=8, context=1 << 20, kv_dtype="fp8")
    print(p.text()); d = p.to_dict()        # d["per_gpu"]["total_bytes"], d["weights_total_bytes"], ...

Modules: formulas.py (closed forms of K3.md, pinned by tests), layout.py (TP/EP and how each param is stored),
memory.py (weights and per-GPU memory, fit search), cost.py (per-op FLOPs/bytes per step, phases,
`mla_mode_costs`), roofline.py (points, KV throughput, bench JSON), report.py (`plan`, JSON, text), plot.py.
"""
from .cost import Cost, CostModel, MLAModeCosts, Step, mla_crossover_new_tokens, mla_mode_costs
from .layout import ParallelLayout, classify_params, mxfp4_selected
from .memory import MemoryConfig, MemoryPlanner, weight_report
from .report import Plan, plan, write_plot

__all__ = ["plan", "Plan", "write_plot", "Cost", "CostModel", "Step", "MLAModeCosts", "mla_mode_costs",
           "mla_crossover_new_tokens", "ParallelLayout", "classify_params", "mxfp4_selected", "MemoryConfig",
           "MemoryPlanner", "weight_report"]
