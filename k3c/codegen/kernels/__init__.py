"""Kernel emitters: one family per file, each `emit_<family>(..., target) -> KernelSource`, specialised on the
model's shapes with block sizes from the Target (common.py holds the rules). k3c.runtime.kernel_impls launches them."""
from .common import EpiAct, GemmPlan, GluAct, RowPlan, elementwise_plan, epi_act, gemm_plan, glu_act, row_plan
from .embedding import emit_embedding
from .gemm import emit_gemm, emit_gemm_glu
from .rmsnorm import emit_rmsnorm

__all__ = ["emit_rmsnorm", "emit_embedding", "emit_gemm", "emit_gemm_glu",
           "GluAct", "EpiAct", "glu_act", "epi_act", "RowPlan", "GemmPlan", "row_plan", "elementwise_plan",
           "gemm_plan"]
