"""CUDA-graph decode: one decode step (T = 1) of a compiled graph captured once per (batch, length bucket) and
replayed, so a step costs one graph launch instead of ~170 kernel launches and the torch glue between them
(the eager step is host-bound: docs/runtime.md, "CUDA graphs").

    dg = DecodeGraph.for_session(sess, capacity=4096)     # after sess.prefill(...): takes over its cache
    logits = dg.step(next_ids)                            # [B] -> [B, vocab] (a static buffer: clone to keep)
    dg.report                                             # captured buckets, or why it fell back (and to what)
    cache = dg.snapshot()                                 # a LayerCaches to continue eagerly (Session.cache form)

What makes the step capturable (the executor's graph is unchanged; only the cache entries differ):
  - every input lives in a static buffer owned here: token ids [B, 1], per KDA layer the recurrent state and conv
    tails (KDAState), per MLA layer the page pool [pages, PS, L+R] and one block table i32 [B, max_pages], and the
    lengths i32 [B] on the device (kernel_impls/mla.py: DeviceLenLatentCache), shared by the MLA layers;
  - the MLA kernels read the lengths from that tensor and size their grid for the bucket's max length (no
    `torch.tensor(lens)` host copy, no grid that grows with the context); the mode is MQA;
  - the step's new KDA states (the kernels return new tensors) are copied back into the static state buffers and
    the lengths are incremented on the device inside the graph, so replaying it again is the next step;
  - every kernel is launched (JIT-compiled, launch paths memoised) by warm-up runs before the capture; warm-ups
    run without that commit (they write only the latent row at position lens[b], which the real step rewrites).
Buckets: one graph per max length (a multiple of the page size, <= capacity); a step runs the smallest bucket that
holds every sequence's next token, capturing it on first use. All graphs share the static inputs and one memory
pool. Lengths are tracked on the host as well (no sync to pick a bucket).

Fallback: when the graph cannot be captured (no CUDA device, kernels off, an op with a host sync on its decode
path: `capture_blockers`), or the capture itself fails, the object stays usable: `step` runs the same graph
eagerly on the same static buffers (the executor's ordinary host-length path: PagedLatentCache over the static
pool), `report.mode` is "eager" and `report.reason` says why; a warning is issued once. It is never silently
wrong: the eager path is the executor's normal decode.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import ArgumentError
from .caches.context import CallContext
from .executor import LayerCaches, graph_binding
from .caches.latent_format import AUTO, KVFormat, encode_rows, row_width
from .launcher import target_of
from .caches.latent_store import DeviceLenLatentCache, LatentStore, PagedLatentCache, interleaved_block_table
from ..reference.kda import KDAState, kda_zero_state
from .caches.kda_rollback import KDATokens

# ops whose decode path has a host sync or a data-dependent shape on every impl / on the torch impl
_COLLECTIVES = ("all_reduce", "all_gather", "seq_scatter", "reduce_scatter", "seq_gather")
_TORCH_SYNCS = {
    "mla_absorbed": "MLA torch path (kernel_impls/mla.py torch_mla_absorbed: torch.tensor(lens) host copy, "
                    "gather of max(lens) rows: a shape that grows every step)",
    "moe_route": "MoE torch routing (kernel_impls/moe.py torch_route: boolean-mask indexing, a data-dependent "
                 "shape)",
    "moe_gate_up": "MoE torch grouped GEMM (kernel_impls/moe.py _segments: off[0].tolist() host sync, a loop over "
                   "the experts that have tokens)",
    "moe_down": "MoE torch grouped GEMM (kernel_impls/moe.py _segments: off[0].tolist() host sync)",
}


def capture_blockers(module, *, use_kernels: bool, device) -> list[str]:
    """Why the decode step of `module` (lowered IR) cannot be captured in a CUDA graph on `device`, one line per
    reason; empty when it can."""
    out = []
    device = torch.device(device)
    if device.type != "cuda":
        out.append(f"CUDA graphs need a CUDA device (got {device.type})")
    seen = set()
    for op in module.ops:
        kernel = use_kernels and op.attr("impl", None) == "kernel"
        why = None
        if op.op == "mla":
            why = ("plain mla op: its cache is a dense latent tensor [B, T, L+R] that grows (a new allocation) "
                   "every step; compile with the mla-absorb pass")
        elif op.op == "moe":
            why = ("unlowered moe op (reference moe_layer: unique_consecutive + .tolist(), a host sync and a "
                   "data-dependent loop); compile with the moe-lower pass")
        elif op.op in _COLLECTIVES and not collectives_capturable(device):
            why = (f"collective {op.op}: captured only through an initialised NCCL process group (torch.distributed "
                   "is not initialised with the nccl backend here)")
        elif op.op in _TORCH_SYNCS and not kernel:
            why = _TORCH_SYNCS[op.op] + ("" if not use_kernels else " (op not impl=kernel)")
        elif op.op == "mla_absorbed" and op.attr("mode", "auto") == "mha":
            why = "mla_absorbed with mode=mha (the capturable path is MQA)"
        if why and why not in seen:
            seen.add(why)
            out.append(why)
    if not use_kernels and len(out) > (device.type != "cuda"):
        out.append("kernels are off (use_kernels=False): the torch paths above run instead of the kernels")
    return out


def collectives_capturable(device: torch.device) -> bool:
    """Whether torch.distributed runs on NCCL for a CUDA device: its collectives are then kernels on CUDA streams,
    which a CUDA graph captures (every rank captures and replays the same sequence of collectives, in lock step)."""
    import torch.distributed as dist

    return (device.type == "cuda" and dist.is_available() and dist.is_initialized()
            and dist.get_backend() == "nccl")


def pick_bucket(buckets: Sequence[int], need: int) -> int:
    """The smallest bucket (max length) >= need."""
    for b in buckets:
        if b >= need:
            return b
    raise ArgumentError(f"{need} tokens exceed the largest captured length {max(buckets)}")


def make_buckets(capacity: int, page_size: int, buckets: Sequence[int] | None) -> list[int]:
    """Sorted max lengths, each rounded up to a page, the last one = capacity (rounded)."""
    cap = -(-capacity // page_size) * page_size
    got = {cap}
    for b in buckets or ():
        if b < 1:
            raise ArgumentError(f"bucket lengths must be positive, got {b}")
        got.add(min(cap, -(-b // page_size) * page_size))
    return sorted(got)


def _own_state(st: KDAState) -> KDAState:
    """A KDAState whose tensors are distinct buffers (kda_zero_state shares one zero tail among q, k, v)."""
    return KDAState(st.state.clone(), tuple(t.clone() for t in st.conv))


def kda_token_buffers(compiled, batch: int, tokens: int, dtype, device) -> dict:
    """{KDA layer: KDATokens of `batch` rows x `tokens` tokens}: per-token state buffers that verification graphs
    of up to `batch` sequences can share (DecodeGraph(kda_tokens=))."""
    spec = compiled.spec
    layers = [i for i, k in enumerate(spec.layer_kinds) if k == "kda"]
    if not layers:
        return {}
    zero = kda_zero_state(_local_kda(compiled.module, spec.kda), batch, dtype, device)
    return {i: KDATokens.like(zero, tokens) for i in layers}


def _local_kda(module, cfg):
    """The KDA config of this rank's heads: a TP-sharded graph's KDA ops carry num_heads / tp (the `shard` pass)."""
    import dataclasses

    heads = {op.attr("num_heads") for op in module.ops if op.attr("layer", None) is not None
             and op.attr("num_heads", None) is not None and op.op.startswith("kda")}
    if len(heads) > 1:
        raise ArgumentError(f"KDA ops disagree on their head count: {sorted(heads)}")
    return dataclasses.replace(cfg, num_heads=heads.pop()) if heads else cfg


# ---- capture backends: real CUDA graphs, and an eager stand-in with the same static-buffer contract (tests) ------
class CudaGraphBackend:
    """torch.cuda.CUDAGraph: warm-ups on a side stream, capture into a shared memory pool, replay."""

    name = "cuda"

    def __init__(self, warmups: int = 2):
        self.warmups = warmups
        self.pool = None

    def capture(self, warm: Callable[[], Any], body: Callable[[], tuple]) -> tuple[Callable[[], None], tuple]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmups):
                warm()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            outs = body()
        return g.replay, outs


class EagerBackend:
    """A stand-in for CUDA graphs (CPU tests) with the same contract: `capture` runs the warm-ups (no commit, as on
    a GPU) and keeps copies of a run's outputs as "the graph's output buffers" without changing any state (a real
    capture executes nothing); `replay` runs the committing body and copies its results into those buffers, which
    is what a replay does to a graph's outputs. Callers that keep a reference to the outputs see them change."""

    name = "eager"

    def __init__(self, warmups: int = 1):
        self.warmups = warmups
        self.captures = 0
        self.replays = 0

    def capture(self, warm, body):
        for _ in range(self.warmups):
            warm()
        self.captures += 1
        outs = warm()                     # the outputs' shapes / buffers, without committing (see DecodeGraph)
        outs = tuple(o.clone() for o in outs)

        def replay():
            self.replays += 1
            for o, n in zip(outs, body()):
                o.copy_(n)
        return replay, outs


@dataclass
class GraphReport:
    mode: str = "graph"                      # "graph" (captured replays) or "eager" (fallback)
    reason: str | None = None                # why eager
    backend: str = ""
    buckets: list[int] = field(default_factory=list)        # max lengths
    captured: dict[int, float] = field(default_factory=dict)  # bucket -> seconds of warm-up + capture
    replays: int = 0
    eager_steps: int = 0

    def __str__(self) -> str:
        if self.mode == "eager":
            return f"decode graph: EAGER fallback ({self.reason})"
        caps = ", ".join(f"{b} ({s:.2f} s)" for b, s in sorted(self.captured.items())) or "none yet"
        return (f"decode graph: {self.backend} replay, buckets {self.buckets}, captured {caps}, "
                f"{self.replays} replays")


class DecodeGraph:
    """Captured decode steps of one batch of `batch` sequences, up to `capacity` tokens each (see module doc)."""

    def __init__(self, compiled, graph, *, batch: int, capacity: int, device, use_kernels: bool = True,
                 dtype: torch.dtype | None = None, page_size: int | None = None,
                 buckets: Sequence[int] | None = None, backend=None, strict: bool = False,
                 pools: dict[int, torch.Tensor] | None = None, kv: KVFormat = AUTO, tokens: int = 1,
                 kda_slots: dict | None = None, kda_tokens: dict | None = None):
        if batch < 1 or capacity < 1 or tokens < 1:
            raise ArgumentError(f"batch, capacity and tokens must be positive, got {batch}, {capacity}, {tokens}")
        # tokens > 1: a speculative verification call (the last token and a draft per sequence); each run writes
        # the KDA states after every token into static buffers (`trace`, runtime/caches/kda_rollback.py)
        self.tokens = tokens
        self.trace: dict | None = None               # the last run's KDA trace (tokens > 1)
        self._traces: dict = {}                      # bucket (None: eager) -> the trace its runs fill
        self._restore = None                         # kda_rollback.CapturedRestore, made on the first restore()
        self.compiled, self.graph, self.spec = compiled, graph, compiled.spec
        self.binding = graph_binding(graph)          # the graph owner's Binding: its kernels, captured here
        self.device = torch.device(device)
        self.batch, self.use_kernels = batch, use_kernels
        self.dtype = dtype or graph.w_embed_tokens_weight.dtype
        spec = self.spec
        self.kda_layers = [i for i, k in enumerate(spec.layer_kinds) if k == "kda"]
        self.mla_layers = [i for i, k in enumerate(spec.layer_kinds) if k == "mla"]
        if pools is not None:                        # a serving pool (Engine.pool.pools): pages via set_block_table
            page_size = next(iter(pools.values())).shape[1] if pools else page_size
        self.page_size = page_size or target_of(self.binding, self.device).mla_page_size
        self.buckets = make_buckets(capacity, self.page_size, buckets)
        self.capacity = self.buckets[-1]
        # ---- static inputs
        dev = self.device
        self.ids = torch.zeros(batch, tokens, dtype=torch.long, device=dev)
        kda_cfg = _local_kda(compiled.module, spec.kda) if self.kda_layers else None
        # kda_slots: another DecodeGraph's of this batch size (the engine's decode and verification graphs share
        # them, so switching between the two copies no state)
        self.kda = kda_slots if kda_slots is not None else \
            {i: _own_state(kda_zero_state(kda_cfg, batch, self.dtype, dev)) for i in self.kda_layers}
        # the states after each of a verification's tokens (shared by its buckets: tokens x the slots' bytes);
        # kda_tokens: buffers of at least this batch and these tokens to take the first rows of (the engine's
        # verification graphs of every batch size share one set: one verification call runs at a time)
        self.kda_tokens = {}
        if tokens > 1:
            self.kda_tokens = {i: KDATokens.like(st, tokens) for i, st in self.kda.items()} if kda_tokens is None \
                else {i: kda_tokens[i].rows(batch) for i in self.kda}
        pages = self.capacity // self.page_size
        self.kv = kv
        self.pool_dtype = kv.pool_dtype(self.dtype)  # own pools' row format; given pools keep theirs
        width = row_width(spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim, self.pool_dtype) if spec.mla else 0
        if pools is None:                            # own pools, pages interleaved (page p of row b: p * B + b)
            self.pools = {i: torch.zeros(pages * batch, self.page_size, width, dtype=self.pool_dtype, device=dev)
                          for i in self.mla_layers}
            self.block_table = interleaved_block_table(batch, pages, dev)
        else:
            if sorted(pools) != self.mla_layers:
                raise ArgumentError(f"pools given for layers {sorted(pools)}, the MLA layers are {self.mla_layers}")
            self.pools = dict(pools)
            self.block_table = torch.zeros(batch, pages, dtype=torch.int32, device=dev)
        self.lens_dev = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.lens = [0] * batch                      # host copy of the lengths (bucket choice, checks)
        self.mla_modes = {i: "mqa" for i in self.mla_layers}
        # ---- graphs
        self._replays: dict[int, tuple[Callable, tuple]] = {}
        self.report = GraphReport(buckets=list(self.buckets))
        if backend is None:
            backend = CudaGraphBackend() if self.device.type == "cuda" else None
        self.backend = backend
        blockers = capture_blockers(compiled.module, use_kernels=use_kernels, device=self.device)
        if backend is not None and not isinstance(backend, CudaGraphBackend):
            blockers = [b for b in blockers if not b.startswith("CUDA graphs need")]   # a stand-in backend
        if backend is None and not blockers:
            blockers = ["no capture backend"]
        self.report.backend = getattr(backend, "name", "")
        if blockers:
            self._fall_back("; ".join(blockers), strict)

    @classmethod
    def for_session(cls, sess, capacity: int, **kw) -> "DecodeGraph":
        """A DecodeGraph over a Session's graph, loaded with its current cache (after a prefill)."""
        if sess.cache is None:
            raise ArgumentError("for_session() needs a session with a cache (run prefill first)")
        b = next((e.batch for e in sess.cache.layers if isinstance(e, PagedLatentCache)), None)
        if b is None:
            b = next(e.state.shape[0] for e in sess.cache.layers if isinstance(e, KDAState))
        dg = cls(sess.compiled, sess.graph, batch=b, capacity=capacity, device=sess.device,
                 use_kernels=sess.use_kernels, **kw)
        dg.load(sess.cache)
        return dg

    # -- state in / out -------------------------------------------------------------------------------------------
    def _fall_back(self, reason: str, strict: bool = False) -> None:
        if strict:
            raise ArgumentError(f"decode step not capturable: {reason}")
        self.report.mode, self.report.reason = "eager", reason
        warnings.warn(f"k3c decode graph: running eagerly: {reason}", RuntimeWarning, stacklevel=3)

    def load_state(self, kda: dict, latent: dict, lens: Sequence[int]) -> None:
        """Set the state directly: kda {KDA layer: KDAState of this batch}, latent {MLA layer: rows [B, n, L+R]
        (n >= max(lens); row b's first lens[b] rows are used; values, stored in the pool's format)}, lens: cached
        tokens per sequence."""
        lens = [int(n) for n in lens]
        if len(lens) != self.batch or max(lens) >= self.capacity:
            raise ArgumentError(f"lens {lens}: need {self.batch} lengths below capacity {self.capacity}")
        for i in self.kda_layers:
            self.kda[i].state.copy_(kda[i].state)
            for d, s_ in zip(self.kda[i].conv, kda[i].conv):
                d.copy_(s_)
        for i in self.mla_layers:
            for b, n in enumerate(lens):
                if n:
                    self._write_rows(i, b, 0, encode_rows(latent[i][b, :n], self.spec.mla.kv_lora_rank,
                                                          self.pools[i].dtype))
        self.set_lengths(lens)

    def load(self, cache: LayerCaches) -> None:
        """Copy a LayerCaches (KDAState and PagedLatentCache entries, equal lengths) into the static buffers."""
        lens = None
        for i in self.mla_layers:
            e = cache.layers[i]
            if not isinstance(e, PagedLatentCache):
                raise ArgumentError(f"layer {i}: expected a paged MLA cache, got {type(e).__name__}")
            if e.batch != self.batch:
                raise ArgumentError(f"layer {i}: cache holds {e.batch} sequences, the graph {self.batch}")
            lens = list(e.lens) if lens is None else lens
            if list(e.lens) != lens:
                raise ArgumentError("MLA layers disagree on the cached lengths")
        lens = lens if lens is not None else [cache.length] * self.batch
        if max(lens) >= self.capacity:
            raise ArgumentError(f"cached length {max(lens)} leaves no room below capacity {self.capacity}")
        for i in self.mla_layers:
            e = cache.layers[i]
            for b, n in enumerate(lens):
                if n:
                    self._write_rows(i, b, 0, e.gather(0, n, seq=b)[0])
        for i in self.kda_layers:
            st = cache.layers[i]
            dst = self.kda[i]
            if st is None:
                dst.state.zero_()
                for t in dst.conv:
                    t.zero_()
                continue
            dst.state.copy_(st.state)
            for d, s in zip(dst.conv, st.conv):
                d.copy_(s)
        self.set_lengths(lens)

    def _write_rows(self, layer: int, b: int, start: int, rows: torch.Tensor) -> None:
        pos = torch.arange(start, start + rows.shape[0], device=self.device)
        pages = self.block_table[b, pos // self.page_size].long()
        pool = self.pools[layer]
        if rows.dtype != pool.dtype or rows.shape[-1] != pool.shape[-1]:
            raise ArgumentError(f"layer {layer}: cache rows are {rows.dtype} x {rows.shape[-1]}, the graph's pool "
                                f"{pool.dtype} x {pool.shape[-1]} (make the graph with the cache's kv_dtype)")
        pool[pages, pos % self.page_size] = rows

    def set_block_table(self, block_table: torch.Tensor) -> None:
        """Copy a block table [B, n <= capacity / page_size] (i32; a serving pool's page ids) into the static one
        (columns past n keep their old ids: set them to a page the caller owns if rows may reach them)."""
        n = block_table.shape[1]
        if block_table.shape[0] != self.batch or n > self.block_table.shape[1]:
            raise ArgumentError(f"block table {tuple(block_table.shape)} does not fit {tuple(self.block_table.shape)}")
        self.block_table[:, :n].copy_(block_table, non_blocking=True)

    def set_lengths(self, lens: Sequence[int]) -> None:
        self.lens = [int(n) for n in lens]
        host = torch.tensor(self.lens, dtype=torch.int32)
        if self.device.type == "cuda":               # pinned + non-blocking: no device sync
            host = host.pin_memory()
        self.lens_dev.copy_(host, non_blocking=True)

    def snapshot(self) -> LayerCaches:
        """The current state as a LayerCaches of host-length entries (copies): continue it eagerly (Session form)."""
        out = LayerCaches(self.spec.num_layers, CallContext(self.binding, self.kv))
        for i, st in self.kda.items():
            out.layers[i] = KDAState(st.state.clone(), tuple(t.clone() for t in st.conv))
        for i, pool in self.pools.items():
            out.layers[i] = PagedLatentCache(LatentStore(pool.clone(), self.block_table.clone(), self.lens),
                                             tuple(self.lens))
        out.length = max(self.lens) if len(set(self.lens)) == 1 else 0
        return out

    # -- the step -------------------------------------------------------------------------------------------------
    def _cache(self, max_len: int | None) -> LayerCaches:
        """The executor's cache over the static buffers: device lengths (max_len given: the capturable path) or
        host lengths (the eager path)."""
        c = LayerCaches(self.spec.num_layers, CallContext(self.binding, self.kv, mla_modes=dict(self.mla_modes)))
        for i, st in self.kda.items():
            c.layers[i] = st
        if self.tokens > 1:
            c.ctx.kda_trace, c.ctx.kda_token_buffers = {}, self.kda_tokens
        for i, pool in self.pools.items():
            if max_len is None:
                c.layers[i] = PagedLatentCache(LatentStore(pool, self.block_table, self.lens), tuple(self.lens))
            else:
                c.layers[i] = DeviceLenLatentCache(LatentStore(pool, self.block_table, self.lens), self.lens_dev,
                                                   max_len)
        return c

    def _run(self, max_len: int | None, commit: bool) -> tuple[torch.Tensor]:
        cache = self._cache(max_len)
        with torch.no_grad():
            logits = self.graph(self.ids, cache)
            if commit:
                for i, st in self.kda.items():
                    new = cache.layers[i]
                    if new is not st:
                        st.state.copy_(new.state)
                        for d, s in zip(st.conv, new.conv):
                            d.copy_(s)
                self.lens_dev.add_(self.tokens)
                if self.tokens > 1:          # a replay refills these tensors: they are the trace of every replay
                    self._traces[max_len] = cache.ctx.kda_trace
        return (logits,)

    def _capture(self, bucket: int) -> None:
        t0 = time.perf_counter()
        self._replays[bucket] = self.backend.capture(lambda: self._run(bucket, commit=False),
                                                     lambda: self._run(bucket, commit=True))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.report.captured[bucket] = time.perf_counter() - t0

    def capture_all(self) -> None:
        """Capture every bucket now (else each is captured on first use)."""
        for b in self.buckets:
            if self.report.mode == "graph" and b not in self._replays:
                self._try_capture(b)

    def _try_capture(self, bucket: int) -> bool:
        try:
            self._capture(bucket)
            return True
        except Exception as e:                       # noqa: BLE001  (reported, then the eager path runs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._fall_back(f"capture of the {bucket}-token bucket failed: {type(e).__name__}: {e}")
            return False

    def step(self, next_ids) -> torch.Tensor:
        """One decode step: next_ids [B] (tensor or ints) -> logits [B, vocab]; with tokens > 1, next_ids [B,
        tokens] -> logits [B, tokens, vocab] and `trace` the KDA trace of this call. Replays return the graph's
        static output buffer (overwritten by the next step: clone it to keep)."""
        need = max(self.lens) + self.tokens
        if need > self.capacity:
            raise ArgumentError(f"sequences of {max(self.lens)} cached tokens are at capacity {self.capacity}")
        ids = next_ids if isinstance(next_ids, torch.Tensor) else torch.tensor(next_ids, dtype=torch.long)
        if ids.numel() != self.batch * self.tokens:
            raise ArgumentError(f"expected {self.batch} x {self.tokens} token ids, got {ids.numel()}")
        self.ids.copy_(ids.reshape(self.batch, self.tokens), non_blocking=True)
        out, bucket = None, None
        if self.report.mode == "graph":
            bucket = pick_bucket(self.buckets, need)
            if bucket in self._replays or self._try_capture(bucket):
                replay, outs = self._replays[bucket]
                replay()
                self.report.replays += 1
                out = outs[0]
        if out is None:
            bucket = None
            out = self._run(None, commit=True)[0]
            self.report.eager_steps += 1
        self.lens = [n + self.tokens for n in self.lens]
        self.trace = self._traces.get(bucket)
        return out[:, 0] if self.tokens == 1 else out

    def restore(self, keeps: list[int]) -> None:
        """After a verification step (tokens > 1): row b of the KDA slots back to its state after the first keeps[b]
        tokens of the step. The step's trace lives in the static per-token buffers, so the restore is captured
        once (kda_rollback.CapturedRestore: one replay, not a gather per tensor and layer); eager otherwise."""
        from .caches.kda_rollback import CapturedRestore, restore

        trace = self.trace
        if not trace:
            raise ArgumentError("restore() follows a verification step (tokens > 1)")
        if self.report.mode != "graph" or any(trace[i] is not self.kda_tokens.get(i) for i in trace):
            restore(trace, self.kda, keeps)
            return
        if self._restore is None:
            self._restore = CapturedRestore(self.backend, self.kda_tokens, self.kda)
        self._restore(keeps)

    def eager_step(self, next_ids, *, device_lengths: bool = False) -> torch.Tensor:
        """The same step run eagerly on the same buffers, whatever the mode: through the executor's ordinary
        (host-length) path, the baseline that replays are compared with and timed against; with `device_lengths`,
        the captured path itself (device lengths, the bucket's grid), which a replay must equal bit for bit."""
        ids = next_ids if isinstance(next_ids, torch.Tensor) else torch.tensor(next_ids, dtype=torch.long)
        self.ids.copy_(ids.reshape(self.batch, 1), non_blocking=True)
        bucket = pick_bucket(self.buckets, max(self.lens) + 1) if device_lengths else None
        out = self._run(bucket, commit=True)[0]
        self.lens = [n + 1 for n in self.lens]
        return out[:, 0]
