"""Bindings (k3c.runtime.launcher.Binding): each model's kernels come from its own Binding, owned by its session or
engine and carried by its call contexts; nothing is bound to a device, so two models on one device launch their own
kernels side by side, in any order, with no re-binding. Checked without a GPU: on meta tensors (what the catalogue
coverage test records: the kernels each model's target would launch) and through the launcher's resolution of a
launch on a cuda slot (host state: which artifact's binary a launch would load)."""
from __future__ import annotations

import pytest
import torch

import k3c
from k3c.codegen.targets import get_target
from k3c.runtime import launcher
from k3c.runtime.launcher import Binding, Catalogue

TINY = "examples/k3-tiny.yaml"


def _meta_session(model):
    w = {op.attr("name"): torch.empty(op.types[0].shape, dtype=torch.bfloat16, device="meta")
         for op in model.module.ops if op.op == "param"}
    return model.session(w, device="meta", max_batch=2, max_context=24)


def test_two_sessions_on_one_device_each_launch_their_own_kernels():
    models = {t: k3c.compile(TINY, target=t) for t in ("h100", "mi355x")}
    keys = {t: {ks.key for ks in m.kernels()} for t, m in models.items()}
    assert keys["h100"] != keys["mi355x"]                  # the targets plan different kernels for the same model
    sessions = {t: _meta_session(m) for t, m in models.items()}
    assert {t: s.binding.target.name for t, s in sessions.items()} == {"h100": "h100", "mi355x": "mi355x"}
    launched = {t: set() for t in models}
    # interleaved: the second session made (and every call of the other) must not change what the first launches
    for step in ("prefill", "decode", "prefill"):
        for t, sess in sessions.items():
            with launcher.recording() as rec:
                if step == "prefill":
                    sess.prefill(torch.zeros(2, 5, dtype=torch.long))
                else:
                    sess.decode(torch.zeros(2, dtype=torch.long))
            assert rec, (t, step)
            launched[t] |= {ks.key for ks in rec}
    for t, own in launched.items():
        assert own <= keys[t], f"{t}: launched keys outside its own catalogue: {sorted(own - keys[t])[:3]}"
    assert launched["h100"] - keys["mi355x"] and launched["mi355x"] - keys["h100"]


def _ks(name):
    """A distinct kernel per name (its key is what a catalogue lists)."""
    from k3c.codegen.kernels import emit_rmsnorm

    return emit_rmsnorm({"a": 64, "b": 128, "shared": 32}[name], 1e-6, target=get_target("h200"), dtype="fp32")


def _cat(root, names, target="h200"):
    return Catalogue(get_target(target), root, {_ks(n).key: f"{root}:{n}" for n in names})


@pytest.fixture
def resolved(monkeypatch):
    """launcher._runner's answer for kernel `name` under `binding` on cuda:7: (artifact root, entry) for a binary,
    "jit" for a JIT compile (nothing is loaded or compiled, no GPU is touched)."""
    monkeypatch.setattr(launcher, "_binary_runner", lambda cat, entry, slot: (cat.root, entry))
    monkeypatch.setattr(launcher, "_jit_runner", lambda p, ks: "jit")
    monkeypatch.setattr(launcher, "can_build", lambda ks: True)
    launcher._PREPARED.clear()                     # runners memoised by earlier tests resolved for real

    def resolve(binding, name):
        ks = _ks(name)
        return launcher._runner(launcher._prepared(ks), ks, torch.device("cuda", 7), binding)
    yield resolve
    launcher._PREPARED.clear()


def test_two_bindings_on_one_device_resolve_from_their_own_artifacts(resolved):
    target = Binding(_cat("target", ["a", "shared"]), get_target("h200"), "strict")
    draft = Binding(_cat("draft", ["b", "shared"]), get_target("h200"), "strict")
    assert resolved(target, "a") == ("target", "target:a")
    assert resolved(draft, "b") == ("draft", "draft:b")
    assert resolved(target, "shared") == ("target", "target:shared")     # made later, the draft took nothing away
    assert resolved(draft, "shared") == ("draft", "draft:shared")
    assert resolved(target, "a") == ("target", "target:a")                # memoised per binding
    with pytest.raises(launcher.MissingKernelError, match="is not in the artifact target"):
        resolved(target, "b")                      # the draft's kernel is not the target's: strict refuses it


def test_a_binding_of_another_target_or_policy_leaves_the_first_alone(resolved):
    first = Binding(_cat("first", ["a"]), get_target("h200"), "artifact")
    second = Binding(_cat("second", ["b"], target="h100"), get_target("h100"), "jit")
    assert resolved(second, "b") == "jit"          # the jit policy ignores the binaries
    assert resolved(first, "a") == ("first", "first:a")
    with pytest.warns(RuntimeWarning, match="JIT-compiling its source once"):
        assert resolved(first, "b") == "jit"       # a miss under "artifact": JIT-compiled, said once
    assert resolved(None, "shared") == "jit"       # no binding: JIT
