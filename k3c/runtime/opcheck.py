"""Per-op check of a compiled graph: every op that runs a generated kernel is also run through its torch
implementation on the same inputs (and a copy of the same cache), and the relative error of each output is kept.

Whole-model logits of a random model amplify rounding chaotically (MoE routing flips, AttnRes softmax), so in bf16
the per-op errors are the meaningful measure of the kernels:

    report = check_ops(compiled, weights, input_ids, decode_steps=2, device="cuda")
    print(format_report(report))
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .caches.context import CallContext
from .executor import TORCH_IMPLS, LayerCaches, build_graph_module


@dataclass
class OpError:
    op: str
    value: str          # IR result name
    phase: str          # prefill | decode
    rel_err: float
    finite: bool


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32 (||a - b|| when b is zero)."""
    den = float(b.float().norm())
    num = float((a.float() - b.float()).norm())
    return num / den if den > 0 else num


def _phase1_parts(packed: torch.Tensor) -> list[torch.Tensor]:
    # packed phase-1 rows [lse bits, padding, o]: compare o and the lse, never the unused padding
    from ..ir.attnres_ops import STATS
    from .kernel_impls.attnres import lse_view

    return [packed[..., STATS:], lse_view(packed)]


# ops whose single result packs several values; everything else is compared output by output
SPLIT_OUTPUTS = {"attn_res_phase1": _phase1_parts}


def _outputs(op_name: str, x) -> list[torch.Tensor]:
    outs = list(x) if isinstance(x, (tuple, list)) else [x]
    split = SPLIT_OUTPUTS.get(op_name)
    return [p for o in outs for p in split(o)] if split else outs


def check_ops(compiled, weights: dict[str, torch.Tensor], input_ids: torch.Tensor, *, decode_steps: int = 1,
              device: str = "cpu", kernel_policy: str = "artifact") -> list[OpError]:
    """Run prefill on input_ids[:, :-decode_steps] and the remaining tokens as decodes, comparing every kernel op
    with its torch implementation fed the same inputs. On a GPU the kernels come from the model's artifact
    (session.bind_kernels with `kernel_policy`)."""
    from .session import bind_kernels

    if device == "cpu":
        from ..codegen.triton_mode import prepare_interpreter

        prepare_interpreter()
    binding = bind_kernels(compiled, torch.device(device), kernel_policy)
    phase = {"name": "prefill"}
    errors: list[OpError] = []

    def wrap(op, fn):
        if op.attr("impl", None) != "kernel" or op.op not in TORCH_IMPLS:
            return fn
        ref = TORCH_IMPLS[op.op]

        def checked(a, cache, data, params):
            ref_out = ref(a, cache.copy(), data, params)
            out = fn(a, cache, data, params)
            for got, want in zip(_outputs(op.op, out), _outputs(op.op, ref_out)):
                errors.append(OpError(op.op, op.results[0], phase["name"], rel_error(got, want),
                                      bool(torch.isfinite(got.float()).all())))
            return out
        return checked

    from .weight_prep import prepare_weights

    # what the graph reads (packed MXFP4 experts quantized from float stacks, shapes checked), once
    on_device = {k: v.to(device) for k, v in prepare_weights(compiled.module, weights, compiled.spec).items()}
    gm = build_graph_module(compiled.module, on_device, use_kernels=True, wrap=wrap, binding=binding)
    ids = input_ids.to(device)
    t = ids.shape[1] - decode_steps
    cache = LayerCaches(compiled.spec.num_layers, CallContext(binding))
    with torch.no_grad():
        gm(ids[:, :t], cache)
        cache.length = t
        phase["name"] = "decode"
        for i in range(decode_steps):
            gm(ids[:, t + i:t + i + 1], cache)
            cache.length += 1
    return errors


def summarize(errors: list[OpError]) -> dict[tuple[str, str], tuple[int, float, bool]]:
    """(op, phase) -> (count, max relative error, all finite)."""
    out: dict[tuple[str, str], tuple[int, float, bool]] = {}
    for e in errors:
        n, worst, fin = out.get((e.op, e.phase), (0, 0.0, True))
        out[(e.op, e.phase)] = (n + 1, max(worst, e.rel_err), fin and e.finite)
    return out


def format_report(errors: list[OpError]) -> str:
    lines = [f"  {'op':22s} {'phase':8s} {'calls':>5s} {'max rel err':>12s} finite"]
    for (op, ph), (n, worst, fin) in sorted(summarize(errors).items()):
        lines.append(f"  {op:22s} {ph:8s} {n:5d} {worst:12.3e} {fin}")
    return "\n".join(lines)
