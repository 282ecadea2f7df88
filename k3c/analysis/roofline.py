"""Roofline helpers: ridge points, attained-performance points per layer kind and phase, KV throughput, and the
measured-benchmark JSON that `bench/` scripts write.

Measured JSON schema (`k3c-bench/1`): a list of records, or an object {"records": [...]} (other keys ignored):
    [{"name": "kda_chunk_fwd B=1 T=8192", "flops": 1.2e13, "bytes": 3.4e10, "seconds": 0.00262}, ...]
`flops` and `bytes` are the work the kernel must do (not counters), `seconds` the measured median; all > 0.
A record may add "kind" (kda, mla, moe, ...) and "device"; they are kept for labels.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from ..codegen.targets import Target
from ..errors import ArgumentError
from .cost import CostModel, PhaseResult

KV_THROUGHPUT_LENGTHS = (8192, 32768, 131072, 1048576)


@dataclass(frozen=True)
class Point:
    name: str
    flops: float
    bytes: float
    seconds: float
    kind: str = ""

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds if self.seconds else 0.0


def ridge(peak_flops: float, bw: float) -> float:
    """Arithmetic intensity (FLOP/byte) where compute and memory time are equal."""
    return peak_flops / bw


def roofline_flops_per_s(intensity: float, peak_flops: float, bw: float) -> float:
    return min(peak_flops, intensity * bw)


def phase_points(phases: list[PhaseResult]) -> list[Point]:
    """One predicted point per (phase, layer kind): its FLOPs, bytes and roofline seconds per GPU."""
    out = []
    for ph in phases:
        for kind, d in ph.by_kind.items():
            c = d["cost"]
            if c.total_flops > 0 and c.bytes > 0 and d["seconds"] > 0:
                out.append(Point(f"{ph.name} {kind}", c.total_flops, c.bytes, d["seconds"], kind))
    return out


def kv_throughput(cm: CostModel, mla_bytes_per_token: int, kda_state_per_seq_full: float,
                  conv_per_seq_full: float, chunk: int, lengths=KV_THROUGHPUT_LENGTHS) -> list[dict]:
    """Bytes of one sequence's cache after prefilling L tokens (one copy: MLA latent cache + KDA state + conv
    tails, not the TP replicas) over the predicted prefill time of L tokens (roofline + link time)."""
    out = []
    for length in lengths:
        ph = cm.prefill(length, 1, chunk)
        cache = length * mla_bytes_per_token + kda_state_per_seq_full + conv_per_seq_full
        t = ph.total_seconds
        out.append({"context": length, "cache_bytes": cache, "prefill_seconds": t,
                    "bytes_per_s": cache / t if t else math.inf})
    return out


def load_measured(path: str) -> list[Point]:
    """Read a bench JSON file (schema above); a bad file is a user error (exit 2)."""
    from ..paths import regular_file

    regular_file(path, "file", error=lambda msg: ArgumentError(f"--measured {msg}"))   # a FIFO: never ends
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ArgumentError(f"--measured {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ArgumentError(f"--measured {path}: not valid JSON ({exc})") from None
    records = data.get("records") if isinstance(data, dict) else data
    if not isinstance(records, list):
        raise ArgumentError(f"--measured {path}: expected a list of {{name, flops, bytes, seconds}} records")
    out = []
    for i, r in enumerate(records):
        where = f"--measured {os.path.basename(path)}: record {i}"
        if not isinstance(r, dict):
            raise ArgumentError(f"{where}: expected an object with name, flops, bytes, seconds")
        missing = [k for k in ("name", "flops", "bytes", "seconds") if k not in r]
        if missing:
            raise ArgumentError(f"{where}: missing {', '.join(missing)}")
        if not isinstance(r["name"], str):
            raise ArgumentError(f"{where}: 'name' must be a string")
        vals = []
        for k in ("flops", "bytes", "seconds"):
            v = r[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ArgumentError(f"{where} ({r['name']}): '{k}' must be a positive number, got {v!r}")
            vals.append(float(v))
        kind = r.get("kind", "")
        out.append(Point(r["name"], *vals, kind=kind if isinstance(kind, str) else ""))
    return out


def measured_rows(points: list[Point], target: Target, peak: float) -> list[dict]:
    """Each measured point against the roofline at its intensity."""
    rows = []
    for p in points:
        bound = roofline_flops_per_s(p.intensity, peak, target.hbm_bytes_per_s)
        rows.append({"name": p.name, "flops": p.flops, "bytes": p.bytes, "seconds": p.seconds,
                     "intensity": p.intensity, "flops_per_s": p.flops_per_s,
                     "bytes_per_s": p.bytes / p.seconds, "roofline_flops_per_s": bound,
                     "fraction_of_roofline": p.flops_per_s / bound if bound else 0.0})
    return rows
