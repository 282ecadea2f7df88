"""Shared fixtures of the reference-semantics tests."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from k3c.frontend import load_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread_no_grad(one_thread):
    with torch.no_grad():
        yield


@pytest.fixture(scope="session")
def tiny_spec():
    return load_spec(ROOT / "examples" / "k3-tiny.yaml")


@pytest.fixture(scope="session")
def plain_spec(tiny_spec):
    """The other side of every switch: no AttnRes, softplus gate, low-rank output gate, no q_lora, ungated MLA,
    no latent MoE, softmax router without bias or renormalisation, SwiGLU, a scaling factor."""
    r = dataclasses.replace
    return tiny_spec.replace(
        name="k3-tiny-plain",
        attn_res=None,
        kda=r(tiny_spec.kda, gate="softplus", output_gate="low_rank", output_gate_rank=8, conv_kernel=3),
        mla=r(tiny_spec.mla, q_lora_rank=None, output_gate=False),
        mlp=r(tiny_spec.mlp, activation=r(tiny_spec.mlp.activation, kind="swiglu"),
              moe=r(tiny_spec.mlp.moe, latent_dim=None, latent_norm=False, router_activation="softmax",
                    router_bias=False, renormalize=False, routed_scaling_factor=2.446, num_shared_experts=1)),
    )
