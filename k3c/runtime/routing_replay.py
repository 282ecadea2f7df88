"""Routing replay: record the experts every router call picks, then make a later run pick the same ones.

Why: top-k routing is discontinuous. Two runs whose hidden states differ by rounding (a sharded run's all-reduce
adds partial sums in another order) pick a different expert wherever the k-th and (k+1)-th scores are that close,
and one such flip moves that token's output by O(1). Replaying the first run's choices in the second separates
those flips from real differences (a wrong shard, a missed reduction): with the same experts chosen, whatever
difference remains is the sharding's own rounding. The routing weights are still this run's scores at the
replayed experts, so only the discrete choice is frozen.

    rec = RoutingReplay.record()
    with rec:  run()                                  # every router call appends its expert ids
    rec.save("routes.safetensors")
    rep = RoutingReplay.replay(load_routes("routes.safetensors", device))
    with rep:  run_sharded()                         # router calls take the recorded ids, in call order
    rep.flips, rep.decisions                          # tokens whose own choice differed from the recorded one

The runtime's routers (the executor's torch ops, the kernel path) ask the active replay themselves; the reference
(k3c.reference, pure) takes it as an argument: `ReferenceModel(..., choose_experts=rep.choose)`.

Router calls are matched by order, so both runs must make the same calls in the same order (same layers, same
batch and token counts): a call whose shape differs from the recorded one is an error, not a silent mismatch. The
one exception: a sequence-parallel rank whose routed experts see only its block of the tokens (the `shard` pass
with EP 1) takes that block's rows of the recorded call (its padding rows keep their own choice and are not counted).
Ids stay on the device while recording and replaying (no host synchronisation); not for CUDA-graph capture.
"""
from __future__ import annotations

import torch

from ..reference.moe import routed_weights

_ACTIVE: "RoutingReplay | None" = None


class RoutingReplay:
    def __init__(self, mode: str, routes: list[torch.Tensor] | None = None):
        if mode not in ("record", "replay"):
            raise ValueError(f"routing replay mode must be 'record' or 'replay', got {mode!r}")
        self.mode = mode
        self.routes: list[torch.Tensor] = list(routes or [])
        self.calls = 0                      # router calls seen while active
        self._flips: list[torch.Tensor] = []
        self.decisions = 0                  # tokens routed while replaying

    @classmethod
    def record(cls) -> "RoutingReplay":
        return cls("record")

    @classmethod
    def replay(cls, routes: list[torch.Tensor]) -> "RoutingReplay":
        return cls("replay", routes)

    def __enter__(self) -> "RoutingReplay":
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a routing replay is already active")
        _ACTIVE = self
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        _ACTIVE = None

    @property
    def flips(self) -> int:
        """Tokens (over all replayed router calls) whose own top-k set differed from the recorded one."""
        return int(sum(int(f) for f in self._flips))

    def choose(self, ids: torch.Tensor) -> torch.Tensor:
        """The expert ids [N, k] this router call uses, given the ones it picked itself."""
        i = self.calls
        self.calls += 1
        if ids.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("routing replay cannot run inside CUDA-graph capture")
        if self.mode == "record":
            self.routes.append(ids.detach().clone())
            return ids
        if i >= len(self.routes):
            raise RuntimeError(f"routing replay: router call {i} was not recorded ({len(self.routes)} calls were)")
        rec = self.routes[i].to(device=ids.device, dtype=ids.dtype)
        real = ids.shape[0]
        if tuple(rec.shape) != tuple(ids.shape):
            block = _token_block(rec, ids)
            if block is None:
                raise RuntimeError(f"routing replay: router call {i} routes {tuple(ids.shape)} but the recorded call "
                                   f"routed {tuple(rec.shape)} (the runs make different router calls)")
            rec, real_rows, real = block
            mine, theirs = ids[real_rows].sort(dim=-1).values, rec[real_rows].sort(dim=-1).values
        else:
            mine, theirs = ids.sort(dim=-1).values, rec.sort(dim=-1).values
        self._flips.append((mine != theirs).any(dim=-1).sum())
        self.decisions += real
        return rec

    def save(self, path: str) -> None:
        from safetensors.torch import save_file
        save_file({f"call{i}": r.to("cpu", torch.int32).contiguous() for i, r in enumerate(self.routes)}, path)


def _token_block(rec: torch.Tensor, ids: torch.Tensor):
    """A sequence-parallel rank routing only its block of the tokens (`shard` with EP 1) against a recording of all
    of them: (the recorded ids of this rank's rows, padding rows keep their own choice; mask of the real rows;
    their count), or None when this call is not such a block."""
    from .distributed import state

    st = state()
    if st.seq is None:
        return None
    t, chunk = st.seq
    n, k = rec.shape
    if n % t or ids.shape != (n // t * chunk, k):
        return None
    b, start = n // t, st.seq_rank * chunk
    pos = torch.arange(start, start + chunk, device=ids.device)
    real = (pos < t).repeat(b)                                 # rows [b, chunk] flattened: padding past T
    full = rec.view(b, t, k)[:, start:min(start + chunk, t)]   # this rank's recorded rows
    out = ids.view(b, chunk, k).clone()
    out[:, :full.shape[1]] = full
    return out.view(-1, k), real, b * full.shape[1]


def load_routes(path: str, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Recorded expert ids from `RoutingReplay.save`, in call order, on `device`."""
    from safetensors import safe_open
    with safe_open(path, framework="pt", device="cpu") as fh:
        keys = sorted(fh.keys(), key=lambda k: int(k[4:]))
        return [fh.get_tensor(k).to(device) for k in keys]


def active() -> RoutingReplay | None:
    return _ACTIVE


def replayed_ids(ids: torch.Tensor) -> torch.Tensor:
    """`ids` unless a routing replay is active, then the ids it says this call uses (ids' dtype and device)."""
    return ids if _ACTIVE is None else _ACTIVE.choose(ids)


def active_choice():
    """The active replay's `choose` (what the reference routers take as `choose_experts`), or None."""
    return None if _ACTIVE is None else _ACTIVE.choose


__all__ = ["RoutingReplay", "load_routes", "active", "active_choice", "replayed_ids", "routed_weights"]
