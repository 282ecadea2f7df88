import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K3 = os.path.join(ROOT, "examples", "kimi-k3.yaml")
TINY = os.path.join(ROOT, "examples", "k3-tiny.yaml")
LINEAR = os.path.join(ROOT, "examples", "kimi-linear-48b.yaml")


@pytest.fixture(scope="session")
def k3_model():
    """kimi-k3 compiled once for the whole directory (~1 s)."""
    import k3c

    return k3c.compile(K3, target="mi355x")


@pytest.fixture(scope="session")
def k3_plan(k3_model):
    """The Done-when plan: mi355x, TP 8 (EP = TP), context 1M, fp8 MLA cache."""
    from k3c.analysis import plan

    return plan(k3_model, "mi355x", tp=8, context=1 << 20, kv_dtype="fp8")


@pytest.fixture(scope="session")
def tiny_model():
    import k3c

    return k3c.compile(TINY, target="cpu")


FULL_PIPELINE = ["fuse-residual-norm", "kda-chunk", "mla-absorb", "attnres-split", "codegen", "dce", "cse"]


@pytest.fixture(scope="session")
def k3_frontend():
    """kimi-k3's frontend IR (layer ops: kda, mla, attn_res_mix), no passes."""
    import k3c

    return k3c.compile(K3, target="mi355x", passes=[])


@pytest.fixture(scope="session")
def k3_full():
    """kimi-k3 after every lowering pass (kernel-level kda_*, mla_absorbed, attn_res_phase*)."""
    import k3c

    from k3c.passes import registered_passes

    # every lowering pass this tree has (the default pipeline's order)
    return k3c.compile(K3, target="mi355x", passes=[p for p in FULL_PIPELINE if p in registered_passes()])
