"""Run-time device -> Target (issue 18): targets.target_for_properties from fake device properties (an H200 is not
an H100), launch.target_for on faked torch properties, and a Binding's target for artifact sessions (the device
answers its own row whatever runs on it)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3c.runtime import devices as launch
from k3c.codegen.targets import TARGETS, get_target, target_for_properties
from k3c.codegen.writer import CodegenError
from k3c.errors import ArgumentError

GiB = 1024 ** 3
# (backend, arch, name, total_memory_bytes as torch reports it, shared_memory_per_block_optin) -> row
DEVICES = [
    (("cuda", "sm_90", "NVIDIA H100 80GB HBM3", 85_029_158_912, 232_448), "h100"),
    (("cuda", "sm_90", "NVIDIA H100 NVL", 100_485_038_080, 232_448), "h100"),       # 93.6 GiB: still an H100
    (("cuda", "sm_90", "NVIDIA H200", 150_109_880_320, 232_448), "h200"),
    (("cuda", "sm_90", "NVIDIA H200 MIG 1g.18gb", 17 * GiB, 232_448), "h200"),      # a MIG slice: the name decides
    (("cuda", "sm_90", "", 140 * GiB, 0), "h200"),                                  # no name: > 100 GiB
    (("cuda", "sm_90", "", 80 * GiB, 0), "h100"),
    (("cuda", "sm_100", "NVIDIA B200", 191_537_332_224, 232_448), "b200"),
    (("hip", "gfx942:sramecc+:xnack-", "AMD Instinct MI300X", 205_822_885_888, 65_536), "mi300x"),
    (("hip", "gfx950:sramecc+:xnack-", "AMD Instinct MI355X", 309_220_868_096, 163_840), "mi355x"),
    (("hip", "gfx950", "", 0, 0), "mi355x"),
    (("cpu", "cpu", "", 0, 0), "cpu"),
]


@pytest.mark.parametrize("props,row", DEVICES, ids=[f"{p[0][2] or p[0][1]}-{p[1]}" for p in DEVICES])
def test_target_for_properties(props, row):
    assert target_for_properties(*props) is TARGETS[row]


def test_h200_row_has_h200_numbers():
    h200, h100 = get_target("h200"), get_target("h100")
    assert h200.hbm_bytes_per_s == 4.8e12 and h200.hbm_bytes == 141 * GiB and h200.arch == "sm_90"
    assert h100.hbm_bytes_per_s == 3.35e12 and h100.hbm_bytes == 80 * GiB


def test_unknown_archs_get_a_derived_row():
    ada = target_for_properties("cuda", "sm_89", "NVIDIA L40S", 48 * GiB, 101_376)
    assert ada.name == "cuda_sm_89" and ada.arch == "sm_89" and ada.shared_mem_bytes == 101_376
    assert ada.triton_target == ("cuda", 89, 32) and ada.hbm_bytes_per_s == get_target("h100").hbm_bytes_per_s
    assert target_for_properties("cuda", "sm_86", "", 0, 0).shared_mem_bytes == 96 * 1024
    rdna = target_for_properties("hip", "gfx1100", "AMD Radeon", 24 * GiB, 0)
    assert rdna.name == "hip_gfx1100" and rdna.arch == "gfx1100" and rdna.backend == "hip"
    assert rdna.shared_mem_bytes == get_target("mi300x").shared_mem_bytes
    assert all(t.name not in ("cuda_sm_89", "hip_gfx1100") for t in TARGETS.values())   # the table is untouched
    with pytest.raises(ArgumentError, match="backend"):
        target_for_properties("xpu", "pvc")


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch reports a GPU with the given properties (no GPU needed); the detection cache and overrides are reset."""
    state = {}

    def set_props(*, hip=None, **props):
        state["props"] = SimpleNamespace(**props)
        monkeypatch.setattr(torch.version, "hip", hip, raising=False)
        launch._detected_target.cache_clear()

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: state["props"])
    yield set_props
    launch._detected_target.cache_clear()


def test_target_for_tells_h200_from_h100(fake_gpu):
    fake_gpu(name="NVIDIA H200", major=9, minor=0, total_memory=150_109_880_320,
             shared_memory_per_block_optin=232_448)
    assert launch.target_for("cuda:0") is get_target("h200")
    fake_gpu(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=85_029_158_912,
             shared_memory_per_block_optin=232_448)
    assert launch.target_for("cuda:0") is get_target("h100")
    fake_gpu(name="NVIDIA B200", major=10, minor=0, total_memory=191_537_332_224,
             shared_memory_per_block_optin=232_448)
    assert launch.target_for("cuda:0") is get_target("b200")
    fake_gpu(hip="6.4", name="AMD Instinct MI355X", gcnArchName="gfx950:sramecc+:xnack-", major=9, minor=5,
             total_memory=309_220_868_096, shared_memory_per_block_optin=163_840)
    assert launch.target_for("cuda:0") is get_target("mi355x")
    fake_gpu(hip="6.4", name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-", major=9, minor=4,
             total_memory=205_822_885_888, shared_memory_per_block_optin=65_536)
    assert launch.target_for("cuda:0") is get_target("mi300x")
    assert launch.target_for("cpu") is get_target("cpu")


def test_a_binding_plans_for_its_artifact_target_the_device_keeps_its_own(fake_gpu):
    from k3c.runtime.launcher import Binding, target_of

    fake_gpu(name="NVIDIA H200", major=9, minor=0, total_memory=150_109_880_320,
             shared_memory_per_block_optin=232_448)
    h100 = get_target("h100")
    b = Binding(None, h100, "artifact")                  # an h100 artifact's session on an H200
    assert target_of(b, "cuda:0") is h100 and target_of(b, torch.device("cuda", 0)) is h100
    assert target_of(None, "cuda:0") is get_target("h200")            # nothing bound: the device's own row
    assert launch.target_for("cuda:0") is get_target("h200")          # the binding changed nothing global
    other = Binding(None, get_target("b200"), "jit")                  # a second model on the same device
    assert target_of(other, "cuda:0") is get_target("b200") and target_of(b, "cuda:0") is h100
    # meta has no target of its own: a session there plans for its binding's (a recording of that target)
    assert target_of(Binding(None, get_target("h200"), "jit"), "meta") is get_target("h200")
    with pytest.raises(CodegenError, match="no kernel target"):
        launch.target_for(torch.empty(1, device="meta").device)
    with pytest.raises(CodegenError, match="kernel policy"):
        Binding(None, h100, "sometimes")
    with pytest.raises(CodegenError, match="expected a Target"):
        Binding(None, "h100")
