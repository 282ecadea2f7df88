"""`from k3c.runtime.engine import Engine`: the serving engine, a facade over the rooms of k3c/runtime/serving/
(serving/engine.py; docs/runtime.md)."""
from .serving.engine import Engine
from .serving.requests import ADMISSIONS, StepOutput
from .kernel_impls.mla import batch_mla_mode

__all__ = ["ADMISSIONS", "Engine", "StepOutput", "batch_mla_mode"]
