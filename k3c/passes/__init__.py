"""IR passes: one per file, registered by name with @register_pass; pipelines are lists of names.

    from k3c.passes import run_pipeline
    module, records = run_pipeline(module, "default", dump_dir="dumps/")

PASS_MODULES lists the pass modules (importing one registers its pass); a new pass file is added there.
"""
from . import attnres_split, codegen, cse, dce, fuse_residual_norm, kda_chunk, mla_absorb, moe_lower, mxfp4, shard
from .pipeline import (PIPELINES, PassRecord, available, lower, register_pipeline, resolve_passes, run_pass,
                       run_pipeline)
from .registry import PassContext, PassInfo, get_pass, register_invariant, register_pass, registered_passes

PASS_MODULES = (attnres_split, codegen, cse, dce, fuse_residual_norm, kda_chunk, mla_absorb, moe_lower, mxfp4, shard)

__all__ = ["PASS_MODULES", "PIPELINES", "PassContext", "PassInfo", "PassRecord", "available", "get_pass", "lower",
           "register_invariant", "register_pass", "register_pipeline", "registered_passes", "resolve_passes",
           "run_pass", "run_pipeline"]
