"""IR passes: one per file, registered by name with @register_pass; pipelines are lists of names.

    from k3c.passes import run_pipeline
    module, records = run_pipeline(module, "default", dump_dir="dumps/")

Every module in this package other than registry and pipeline is imported here, so a new pass file registers
itself without touching this list.
"""
import importlib
import pkgutil

from .pipeline import PIPELINES, PassRecord, available, register_pipeline, resolve_passes, run_pass, run_pipeline
from .registry import (PassContext, PassInfo, get_pass, register_invariant, register_pass, registered_passes)

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _mod not in ("registry", "pipeline"):
        importlib.import_module(f"{__name__}.{_mod}")

__all__ = ["PIPELINES", "PassContext", "PassInfo", "PassRecord", "available", "get_pass", "register_invariant",
           "register_pass", "register_pipeline", "registered_passes", "resolve_passes", "run_pass", "run_pipeline"]
