"""Runtime of the absorbed MLA sublayer (`mla_absorbed`, from the mla-absorb pass) and the weight transform
`mla_kvb_split`: the kernel launchers, the MHA / MQA mode choice (batch_mla_mode: the one rule, which the serving
runner also calls), and the torch implementations the executor uses when an op is not marked impl="kernel".

Cache entry (cache.layers[layer]): a PagedLatentCache or DeviceLenLatentCache over a LatentStore
(runtime/caches/latent_store.py); a new store takes the call context's cache format (caches/context.py), an
existing one keeps its format. Kernels are planned for and launched through the call context's Binding.
"""
from __future__ import annotations

import functools
import math

import torch

from ...codegen.kernels.mla import (LATENT_SPLIT_MAX_ROWS, DecodePlan, decode_merge_block, decode_plan,
                                    emit_mla_latent_partial, emit_mla_latent_reduce, emit_mla_latent_write,
                                    emit_mla_merge, emit_mla_prefill)
from ...codegen.kernels.mla_decode import decode_kernel
from ...codegen.targets import Target
from ...frontend.spec import MLASpec
from ... import reference as ref
from ...reference.norms import acc
from ..devices import host_to_device, interpreted, tt_dtype
from ..launcher import Binding, fixed_launcher, launch, target_of, tier_fallback
from ..caches.latent_format import decode_rows, encode_rows, pool_args, row_width
from ..caches.latent_store import (DeviceLenLatentCache, LatentStore, PagedLatentCache, interleaved_block_table,
                                   new_store, reserve)

_emit_write = functools.lru_cache(maxsize=64)(emit_mla_latent_write)
_emit_write_part = functools.lru_cache(maxsize=64)(emit_mla_latent_partial)
_emit_write_reduce = functools.lru_cache(maxsize=64)(emit_mla_latent_reduce)
_decode_kernel = functools.lru_cache(maxsize=64)(decode_kernel)
_emit_merge = functools.lru_cache(maxsize=64)(emit_mla_merge)
_emit_prefill = functools.lru_cache(maxsize=64)(emit_mla_prefill)


# -- weight transform -------------------------------------------------------------------------------------------------
def split_kvb(w_kvb: torch.Tensor, num_heads: int, nope: int, v_dim: int, part: str) -> torch.Tensor:
    """W_kvb [N*(P+V), L] -> W_UK_T [N, P, L] (part "uk_t") or W_UV [N, L, V] (part "uv"), contiguous."""
    w3 = w_kvb.view(num_heads, nope + v_dim, w_kvb.shape[-1])
    if part == "uk_t":
        return w3[:, :nope].contiguous()
    return w3[:, nope:].transpose(1, 2).contiguous()


def torch_mla_kvb_split(a, cache, data, w):
    return split_kvb(w["kv_b_proj.weight"], a["num_heads"], a["qk_nope_head_dim"], a["v_head_dim"], a["part"])


def lens_tensor(lens, device) -> torch.Tensor:
    """Lengths as i32 [B] on `device`: a device tensor is used as is (no copy); host ints are copied through pinned
    staging without a device sync (a pageable copy would make the host wait for every kernel launched before it, in
    each MLA layer of an eager call; no copy is allowed while a CUDA graph is being captured)."""
    if isinstance(lens, torch.Tensor):
        if lens.dtype != torch.int32 or lens.device != torch.device(device):
            raise ValueError(f"lengths tensor must be int32 on {device}, got {lens.dtype} on {lens.device}")
        return lens
    return host_to_device(torch.device(device))(torch.tensor(list(lens), dtype=torch.int32))


# -- kernel launchers -------------------------------------------------------------------------------------------------
def _tgt(t: torch.Tensor, target: Target | None, binding: Binding | None) -> Target:
    return target or target_of(binding, t.device)


def write_latent(x: torch.Tensor, w_dkv: torch.Tensor, norm_w: torch.Tensor, eps: float, store: LatentStore,
                 lens, kv_lora_rank: int, *, target: Target | None = None, split: bool | None = None,
                 splits: int | None = None, binding: Binding | None = None) -> None:
    """Kernel (a): store [RMSNorm(x W_c^T) | x W_r^T] of x [B, T, D] at positions lens[b].. of each sequence.

    split None: the split-K form (two kernels, the weight stream spread over ~2 programs per SM) when B*T <=
    LATENT_SPLIT_MAX_ROWS, else the one-kernel form; True / False force one. splits: K splits of the split form
    (default latent_splits). Both forms are deterministic; the choice depends on shapes only (a CUDA-graph
    replay runs what the eager step runs)."""
    B, T, D = x.shape
    W = w_dkv.shape[0]
    tgt = _tgt(x, target, binding)
    pool = pool_args(store.pool)
    if norm_w.dtype != w_dkv.dtype:
        norm_w = norm_w.to(w_dkv.dtype)
    lens_t = lens_tensor(lens, x.device)
    x2 = x.contiguous().view(B * T, D)
    use_split = (B * T <= LATENT_SPLIT_MAX_ROWS) if split is None else bool(split)
    if not use_split:
        ks = _emit_write(D, kv_lora_rank, W - kv_lora_rank, float(eps), store.page_size, target=tgt,
                         dtype=tt_dtype(x.dtype), w_dtype=tt_dtype(w_dkv.dtype),
                         cache_dtype=tt_dtype(store.pool.dtype), interpret=interpreted(x))
        launch(ks, x2, w_dkv.contiguous(), norm_w.contiguous(), *pool, store.block_table, lens_t, T,
               store.block_table.shape[1], B, binding=binding)
        return
    M = B * T
    S, k_split, ka, kb, slot = _write_setup(M, D, W, kv_lora_rank, float(eps), store.page_size, x.dtype, w_dkv.dtype,
                                            store.pool.dtype, splits, tgt, x.device, interpreted(x), binding)
    ws = torch.empty(S * M * W, dtype=torch.float32, device=x.device)      # partials [S, M, W] (graph-safe)
    _fast_launch(slot, 0, ka, x2, w_dkv if w_dkv.is_contiguous() else w_dkv.contiguous(), ws, M, k_split, S,
                 binding=binding)
    _fast_launch(slot, 1, kb, ws, norm_w if norm_w.is_contiguous() else norm_w.contiguous(), *pool,
                 store.block_table, lens_t, T, store.block_table.shape[1], M, S, binding=binding)


def latent_splits(rows: int, hidden: int, width: int, block_m: int, block_n: int, block_k: int,
                  device: torch.device, waves: int = 2) -> tuple[int, int]:
    """(S, k_split) of the split-K latent write: about `waves` programs per SM over (column tiles, K splits, row
    tiles), each split a whole number of BLOCK_K steps, and the fp32 partials (S x rows x width x 4 bytes) at
    most a quarter of a bf16 weight (S x rows <= hidden / 8)."""
    k_tiles = -(-hidden // block_k)
    base = -(-width // block_n) * -(-rows // block_m)
    want = -(-waves * _sm_count(device.type, device.index) // base)
    want = max(1, min(want, k_tiles, hidden // 8 // max(1, rows)))
    tps = -(-k_tiles // want)
    return -(-k_tiles // tps), tps * block_k


_WRITE_SETUP: dict = {}


def _write_setup(M: int, D: int, W: int, L: int, eps: float, ps: int, dt, wdt, cdt, splits: int | None, tgt: Target,
                 device: torch.device, interp: bool, binding: Binding | None = None):
    """The split-K latent write's shape-only decisions (plan, S, both kernels), memoised like _decode_setup (per
    binding: the slots hold launchers of its kernels)."""
    key = (M, D, W, L, eps, ps, dt, wdt, cdt, splits, id(tgt), device.type, device.index, interp, binding)
    hit = _WRITE_SETUP.get(key)
    if hit is not None and hit[0] is tgt:
        return hit[1]
    ka = _emit_write_part(D, W, target=tgt, dtype=tt_dtype(dt), w_dtype=tt_dtype(wdt), rows_hint=M,
                          interpret=interp)
    bm, bn, bk = (ka.constexprs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    if splits:
        k_tiles = -(-D // bk)
        tps = -(-k_tiles // min(int(splits), k_tiles))
        S, k_split = -(-k_tiles // tps), tps * bk
    else:
        S, k_split = latent_splits(M, D, W, bm, bn, bk, device)
    kb = _emit_write_reduce(L, W - L, eps, ps, target=tgt, w_dtype=tt_dtype(wdt), cache_dtype=tt_dtype(cdt),
                            interpret=interp)
    val = (S, k_split, ka, kb, [None, None])
    if len(_WRITE_SETUP) >= 4096:
        _WRITE_SETUP.clear()
    _WRITE_SETUP[key] = (tgt, val)
    return val


@functools.lru_cache(maxsize=None)
def _sm_count(kind: str, index) -> int:
    if kind == "cuda":
        return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                                ).multi_processor_count
    return 4


def choose_splits(batch: int, tiles: int, pages: int, device: torch.device, max_splits: int = 512,
                  min_pages: int = 2, waves: int = 2) -> int:
    return _choose_splits(batch, tiles, pages, device.type, device.index, max_splits, min_pages, waves)


@functools.lru_cache(maxsize=4096)
def _choose_splits(batch: int, tiles: int, pages: int, kind: str, index, max_splits: int, min_pages: int,
                   waves: int) -> int:
    """KV splits per (sequence, head tile): enough programs to fill the GPU's SMs with little tail (the smallest S
    whose last wave is >= 85% full), each split at least `min_pages` pages."""
    sms = _sm_count(kind, index)
    sms *= waves                                                 # programs resident per SM at once (latency)
    cap = max(1, min(max_splits, pages // min_pages))
    base = batch * tiles
    best, best_eff = 1, 0.0
    for s in range(1, cap + 1):
        progs = base * s
        eff = progs / (math.ceil(progs / sms) * sms)
        if progs >= sms and eff >= 0.85:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best if base * cap >= sms else cap


# A one-program-per-SM program's fixed cost in pages of its loop: the query tile, the first page's latency and the
# fp32 partial it stores (64 x 512 x 4 B: two pages' bytes) before the merge reads it back (bench/mla_hopper.py)
RESIDENT_OVERHEAD_PAGES = 2


def decode_splits(plan, batch: int, tiles: int, pages: int, device: torch.device) -> int:
    """KV splits for a decode plan: a tier kernel holds one program per SM (its shared memory: the hopper tier's
    query tile and two page buffers), so its splits come from the wave count x pages per split; the portable
    kernels' from choose_splits."""
    if plan.tier == "portable":
        return choose_splits(batch, tiles, pages, device)
    return _choose_splits_resident(batch, tiles, pages, device.type, device.index)


@functools.lru_cache(maxsize=4096)
def _choose_splits_resident(batch: int, tiles: int, pages: int, kind: str, index, max_splits: int = 512,
                            min_pages: int = 2) -> int:
    """The S (splits per sequence and head tile) that minimises waves x (pages per split + the fixed cost), one
    program per SM; the smallest S within 2% of that (fewer partials to merge). B=32, 64 pages, 2 head tiles, 132
    SMs: 2 (one wave of 32 pages) where choose_splits gives 8 (four waves of 8)."""
    sms = _sm_count(kind, index)
    cost = {}
    for s in range(1, max(1, min(max_splits, pages // min_pages)) + 1):
        pps = -(-pages // s)
        waves = -(-batch * tiles * -(-pages // pps) // sms)
        cost[s] = waves * (pps + RESIDENT_OVERHEAD_PAGES)
    least = min(cost.values())
    return min(s for s, c in cost.items() if c <= 1.02 * least)


_DECODE_SETUP: dict = {}


def _decode_setup(B: int, ROWS: int, W: int, L: int, ps: int, dt: torch.dtype, cdt: torch.dtype, odt: torch.dtype, plan,
                  n_pages: int, splits: int | None, scale: float, tgt: Target, device: torch.device, interp: bool,
                  binding: Binding | None = None):
    """Everything about a decode call that depends on shapes only (plan, splits, both kernels, grids), memoised
    per binding (what its artifact holds decides the tier fallback; the slots hold launchers of its kernels): the
    per-call host work is two allocations and two launches (small-batch decode is launch-bound)."""
    key = (B, ROWS, W, L, ps, dt, cdt, odt, plan, n_pages, splits, scale, id(tgt), device.type, device.index, interp,
           binding)
    hit = _DECODE_SETUP.get(key)
    if hit is not None and hit[0] is tgt:
        return hit[1]
    plan = plan or decode_plan(ROWS, L, tgt, cache_dtype=tt_dtype(cdt), rope_dim=W - L)

    def kernel(p):
        return _decode_kernel(p, L, W - L, ps, float(scale), target=tgt, dtype=tt_dtype(dt),
                              cache_dtype=tt_dtype(cdt), interpret=interp)

    ks = kernel(plan)
    if plan.tier != "portable" and tier_fallback(ks, device, binding):   # a tier kernel neither loadable nor built
        plan = decode_plan(ROWS, L, tgt, cache_dtype=tt_dtype(cdt), rope_dim=W - L, tiers=False)
        ks = kernel(plan)
    tiles = -(-ROWS // plan.block_h)
    S = splits or decode_splits(plan, B, tiles, n_pages, device)
    pps = max(1, -(-n_pages // S))
    S = max(1, -(-n_pages // pps))
    mk = _emit_merge(L, target=tgt, out_dtype=tt_dtype(odt),
                     block_d=decode_merge_block(B * ROWS, L, _sm_count(device.type, device.index)),
                     write_lse=False, interpret=interp)
    val = (S, pps, ks, mk, [None, None])
    if len(_DECODE_SETUP) >= 4096:
        _DECODE_SETUP.clear()
    _DECODE_SETUP[key] = (tgt, val)
    return val


def _fast_launch(slot: list, i: int, ks, *args, binding: Binding | None) -> None:
    """launch() checks every argument and evaluates the grid; a memoised setup fixes every int that the grid rule
    reads, so after its first (checked) call later calls on a GPU repeat that launch with no checks."""
    fast = slot[i]
    if fast is not None:
        fast(*args)
        return
    slot[i] = fixed_launcher(ks, *args, binding=binding)


def mqa_decode(q: torch.Tensor, store: LatentStore, lens: torch.Tensor, scale: float, kv_lora_rank: int, *,
               num_heads: int, splits: int | None = None, plan=None, target: Target | None = None,
               out_dtype: torch.dtype | None = None, max_len: int | None = None,
               binding: Binding | None = None) -> torch.Tensor:
    """Kernels (b) + merge: q [B, ROWS, L+R] ([q_lat | q_pe], rows token-major (t, head)) against the paged latent
    cache of lengths `lens` (i32 [B], the new tokens included; rows in q's dtype or fp8). Returns o_lat [B, ROWS, L]
    (out_dtype, default q's)."""
    B, ROWS, W = q.shape
    L = kv_lora_rank
    tgt = _tgt(q, target, binding)
    ps = store.page_size
    max_len = int(lens.max()) if max_len is None else max_len      # pass it: lens.max() syncs with the GPU
    n_pages = -(-max_len // ps)
    odt = out_dtype or q.dtype
    interp = interpreted(q)
    if store.pool.dtype not in (q.dtype, torch.float8_e4m3fn) or lens.dtype != torch.int32 \
            or store.block_table.dtype != torch.int32 \
            or lens.device != q.device or store.pool.device != q.device:
        raise ValueError(f"mqa_decode: cache {store.pool.dtype} on {store.pool.device}, lens {lens.dtype} on "
                         f"{lens.device}, block table {store.block_table.dtype} do not fit q {q.dtype} on {q.device} "
                         f"(lens and block table must be int32)")
    S, pps, ks, mk, slot = _decode_setup(B, ROWS, W, L, ps, q.dtype, store.pool.dtype, odt, plan, n_pages, splits,
                                         float(scale), tgt, q.device, interp, binding)
    M = B * ROWS
    ws = torch.empty(S * M * (L + 1), dtype=torch.float32, device=q.device)     # partial o, then its lse
    o_part, lse = ws[: S * M * L], ws[S * M * L:]
    _fast_launch(slot, 0, ks, q if q.is_contiguous() else q.contiguous(), *pool_args(store.pool), store.block_table,
                 lens, o_part, lse, ROWS, num_heads, ROWS // num_heads, store.block_table.shape[1], pps, B, S,
                 binding=binding)
    out = torch.empty(M, L, dtype=odt, device=q.device)
    _fast_launch(slot, 1, mk, o_part, lse, out, lse, M, S, binding=binding)
    return out.view(B, ROWS, L)


def mha_step(q: torch.Tensor, k: torch.Tensor, kpe: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor, shift: int, scale: float, has_prev: bool, *, key_splits: int = 1,
             target: Target | None = None, binding: Binding | None = None) -> None:
    """Kernel (c): one chunk of keys k [B, TK, N, P] | kpe [B, TK, R] (any row stride), values v [B, TK, N, V]
    for q [B, TQ, N, P+R]. key_splits = 1: updates the running o fp32 [B, TQ, N, V] / lse fp32 [B, TQ, N] in place
    (continuing them when has_prev); key_splits = KS > 1: writes KS partials o [KS, B, TQ, N, V], lse [KS, ...]."""
    B, TQ, N, QW = q.shape
    TK, P, V = k.shape[1], k.shape[3], v.shape[3]
    R = QW - P
    if kpe.stride(-1) != 1:
        raise ValueError("k_pe rows must be contiguous")
    if has_prev and key_splits != 1:
        raise ValueError("continuing the running output needs key_splits == 1")
    tgt = _tgt(q, target, binding)
    ks = _emit_prefill(P, R, V, float(scale), target=tgt, dtype=tt_dtype(q.dtype), has_prev=bool(has_prev),
                       tq_hint=TQ, interpret=interpreted(q))
    ks_len = -(-TK // key_splits)
    ks_len = -(-ks_len // ks.constexprs["BLOCK_N"]) * ks.constexprs["BLOCK_N"]
    launch(ks, q, k.contiguous(), kpe, v.contiguous(), o, lse, TQ, TK, N, int(shift), kpe.stride(0),
           kpe.stride(1), B, key_splits, ks_len, binding=binding)


def mha_key_splits(B: int, TQ: int, N: int, TK: int, q: torch.Tensor, target: Target) -> int:
    """Key splits per chunk so that few query tiles (short appends) still fill the GPU: 1 when the query tiles
    alone give two programs per SM."""
    from ...codegen.kernels.mla import prefill_plan

    plan = prefill_plan(TQ, target)
    progs = -(-TQ // plan.block_m) * N * B
    sms = 2 * _sm_count(q.device.type, q.device.index)
    if progs >= sms:
        return 1
    return max(1, min(-(-sms // progs), TK // 256))


def mha_attention(q: torch.Tensor, entry: PagedLatentCache, w_uk_t: torch.Tensor, w_uv: torch.Tensor,
                  scale: float, chunk: int, *, target: Target | None = None, key_splits: int | None = None,
                  binding: Binding | None = None) -> torch.Tensor:
    """MHA mode over the paged cache (new tokens already written; entry.lens include them): keys and values are
    expanded from the latent `chunk` tokens at a time; chunks (and key splits inside a chunk, for short query runs)
    are merged by log-sum-exp. Returns o fp32 [B, T, N, V]."""
    B, T, N, _ = q.shape
    L = w_uk_t.shape[2]
    R = q.shape[-1] - w_uk_t.shape[1]
    V = w_uv.shape[2]
    if len(set(entry.lens)) > 1:        # mixed lengths: one sequence at a time
        return torch.cat([mha_attention(q[b:b + 1], PagedLatentCache(_SeqView(entry.store, b), (entry.lens[b],)),
                                        w_uk_t, w_uv, scale, chunk, target=target, key_splits=key_splits,
                                        binding=binding)
                          for b in range(B)])
    total = entry.lens[0]
    cached = total - T
    q = q.contiguous()
    tgt = _tgt(q, target, binding)
    wk, wv = w_uk_t.to(q.dtype), w_uv.to(q.dtype)
    ksp = key_splits or mha_key_splits(B, T, N, min(chunk, total), q, tgt)
    if ksp == 1:
        o = torch.zeros(B, T, N, V, dtype=torch.float32, device=q.device)
        lse = torch.full((B, T, N), float("-inf"), dtype=torch.float32, device=q.device)
    else:                               # slot 0: the running result; slots 1..KS: this chunk's key splits
        part_o = torch.zeros(ksp + 1, B, T, N, V, dtype=torch.float32, device=q.device)
        part_lse = torch.full((ksp + 1, B, T, N), float("-inf"), dtype=torch.float32, device=q.device)
        o, lse = part_o[0], part_lse[0]
        mk = _emit_merge(V, target=tgt, out_dtype="fp32", interpret=interpreted(q))
    for c0 in range(0, total, chunk):
        lat = decode_rows(entry.gather(c0, min(total, c0 + chunk)), L, R, q.dtype)   # [B, C, L+R]: this chunk
        c = lat[..., :L]
        k = torch.einsum("bkl,npl->bknp", c, wk)
        v = torch.einsum("bkl,nlv->bknv", c, wv)
        if ksp == 1:
            mha_step(q, k, lat[..., L:], v, o, lse, cached - c0, scale, c0 > 0, target=tgt, binding=binding)
        else:
            mha_step(q, k, lat[..., L:], v, part_o[1:], part_lse[1:], cached - c0, scale, False, key_splits=ksp,
                     target=tgt, binding=binding)
            launch(mk, part_o, part_lse, o, lse, B * T * N, ksp + 1, binding=binding)
    return o


class _SeqView(LatentStore):
    """The store seen by one sequence (its block-table row)."""

    def __init__(self, store: LatentStore, b: int):
        super().__init__(store.pool, store.block_table[b:b + 1], store.high[b:b + 1])


# -- the sublayer -----------------------------------------------------------------------------------------------------
def batch_mla_mode(attrs, new: int, cached: list[int], target) -> str:
    """MHA or MQA for one MLA call of `new` tokens per sequence after `cached[b]` cached tokens, from the cost model
    (analysis.cost.mla_mode_costs) over every sequence of the call, on `target`: the one mode rule (the serving
    runner chooses with it per call, an op with no choice made for it chooses with it over its own lengths).
      - MQA is one batched call (split-KV decode over each sequence's own pages, W_kvb read once): the cost of the
        whole batch at the mean cached length (exact: the cost is affine in the cached length);
      - MHA of equal lengths is one batched call too; of mixed lengths it runs one sequence at a time (each expands
        K/V from its own rows and reads W_kvb again): the sum of the per-sequence costs, B x the mean's.
    Every sequence counts: the first sequence's own choice can be the slower one for the batch."""
    from ...analysis.cost import mla_mode_costs

    b = len(cached)
    mean = sum(cached) / b
    both = mla_mode_costs(attrs, new, mean, target, batch=b)
    if len(set(cached)) == 1:
        return both.best
    mha = mla_mode_costs(attrs, new, mean, target, batch=1).mha.scaled(b)
    mha_s = mha.seconds({"bf16": target.peak_bf16_flops}, target.hbm_bytes_per_s)
    return "mha" if mha_s <= both.mqa_seconds else "mqa"


def choose_mode(a, new: int, cached: list[int], target: Target) -> str:
    """The op's mode attr, or for "auto" the faster of MHA and MQA for these cached lengths on `target`
    (batch_mla_mode)."""
    mode = a.get("mode", "auto")
    if mode != "auto":
        return mode
    return batch_mla_mode(a, new, list(cached), target)


def _chosen(a, cache) -> str | None:
    """The mode set for this op: its attr, or for "auto" the caller's choice in the call context (the runner's)."""
    mode = a.get("mode", "auto")
    if mode != "auto":
        return mode
    return (cache.ctx.mla_modes or {}).get(a["layer"])


def call_mode(a, cache, new: int, cached, device) -> str:
    """The mode this call of the op runs (the one set for it, else choose_mode over its lengths on the target its
    binding plans for), recorded in the call context (CallContext.modes: the engine reports it per call)."""
    mode = _chosen(a, cache) or choose_mode(a, new, cached, target_of(cache.ctx.binding, device))
    cache.ctx.modes[a["layer"]] = mode
    return mode


def _finish(a, x: torch.Tensor, o: torch.Tensor, w) -> torch.Tensor:
    """Output gate per (head, channel) after W_UV, then o_proj: o [B, T, N, V] (any float dtype)."""
    n, dv = a["num_heads"], a["v_head_dim"]
    if a["output_gate"]:
        gate = torch.sigmoid(acc(ref.linear(x, w["g_proj.weight"]))).unflatten(-1, (n, dv))
        o = acc(o) * gate
    return ref.linear(o.to(x.dtype).flatten(-2), w["o_proj.weight"])


def _kvb(w) -> torch.Tensor:
    """W_kvb rebuilt from the split (for the reference path): [N*(P+V), L]."""
    uk, uv = w["w_uk_t"], w["w_uv"]
    return torch.cat([uk, uv.transpose(1, 2)], dim=1).reshape(-1, uk.shape[2])


def torch_mla_absorbed(a, cache, data, w):
    """Eager semantics of mla_absorbed on the same paged cache: reference latent, reference attention (mode as
    chosen), scattered into / gathered from the pages with torch indexing."""
    x = data[0]
    cfg = MLASpec.from_attrs(a)
    B, T, _ = x.shape
    entry = cache.layers[a["layer"]]
    new = ref.mla_latent(x, w, cfg)
    L, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    ps = target_of(cache.ctx.binding, x.device).mla_page_size if entry is None else entry.store.page_size
    pdt = _new_store_dtype(cache, x)
    store, lens = reserve(entry, B, T, row_width(L, R, pdt), ps, pdt, x.device)
    pos = torch.arange(T, device=x.device)[None, :] + torch.tensor(lens, device=x.device)[:, None]
    pages = store.block_table.gather(1, (pos // ps).long()).long()
    store.pool[pages, pos % ps] = encode_rows(new, L, store.pool.dtype)
    store.high = [n + T for n in lens]
    entry = PagedLatentCache(store, tuple(n + T for n in lens))
    cache.layers[a["layer"]] = entry
    mode = call_mode(a, cache, T, lens, x.device)
    if len(set(entry.lens)) > 1:           # a serving batch of mixed lengths: each sequence over its own rows
        return torch.cat([_ref_attend(a, x[b:b + 1], entry.gather(0, n, seq=b), w, cfg, mode)
                          for b, n in enumerate(entry.lens)])
    return _ref_attend(a, x, entry.gather(), w, cfg, mode)


def _ref_attend(a, x, rows, w, cfg, mode):
    latent = decode_rows(rows, cfg.kv_lora_rank, cfg.qk_rope_head_dim, x.dtype)
    o = ref.mla_attention(ref.mla_query(x, w, cfg), latent, {"kv_b_proj.weight": _kvb(w)}, cfg, mode)
    return _finish(a, x, o, w)


def _new_store_dtype(cache, x: torch.Tensor) -> torch.dtype:
    """The pool dtype of a store made in this call (its context's cache format)."""
    return cache.ctx.kv.pool_dtype(x.dtype)


def launch_mla_absorbed(a, cache, data, w):
    """mla_absorbed through the generated kernels: latent write (a), then MQA decode (b) or chunked MHA (c)."""
    x = data[0]
    cfg = MLASpec.from_attrs(a)
    B, T, _ = x.shape
    p, r, L = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    scale = (p + r) ** -0.5
    entry = cache.layers[a["layer"]]
    if isinstance(entry, DeviceLenLatentCache):
        return _kernel_mla_device_lens(a, cache, x, w, entry)
    b = cache.ctx.binding
    ps = target_of(b, x.device).mla_page_size if entry is None else entry.store.page_size
    pdt = _new_store_dtype(cache, x)
    store, lens = reserve(entry, B, T, row_width(L, r, pdt), ps, pdt, x.device)
    write_latent(x, w["kv_a_proj_with_mqa.weight"], w["kv_a_layernorm.weight"], a["lora_norm_eps"], store, lens, L,
                 binding=b)
    store.high = [m + T for m in lens]
    entry = PagedLatentCache(store, tuple(m + T for m in lens))
    cache.layers[a["layer"]] = entry
    q = ref.mla_query(x, w, cfg)
    if call_mode(a, cache, T, lens, x.device) == "mqa":
        return _mqa_sublayer(a, x, q, w, store, lens_tensor(entry.lens, x.device), max(entry.lens), b)
    o = mha_attention(q, entry, w["w_uk_t"], w["w_uv"], scale, a["prefill_chunk"], binding=b)
    return _finish(a, x, o, w)


def _mqa_sublayer(a, x, q, w, store: LatentStore, lens: torch.Tensor, max_len: int,
                  binding: Binding | None) -> torch.Tensor:
    """MQA mode after the latent write: absorbed query, split-KV decode over `lens` (i32 [B], new tokens included),
    W_UV, output gate, o_proj."""
    cfg = MLASpec.from_attrs(a)
    B, T, _ = x.shape
    n, p, r, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    q_lat = torch.einsum("btnp,npl->btnl", acc(q[..., :p]), acc(w["w_uk_t"]))
    qq = torch.cat([q_lat, acc(q[..., p:])], dim=-1).to(x.dtype).view(B, T * n, L + r)
    o_lat = mqa_decode(qq, store, lens, (p + r) ** -0.5, L, num_heads=n, max_len=max_len, binding=binding)
    o = torch.einsum("btnl,nlv->btnv", o_lat.view(B, T, n, L), w["w_uv"].to(o_lat.dtype))
    return _finish(a, x, o, w)


def _kernel_mla_device_lens(a, cache, x, w, entry: DeviceLenLatentCache) -> torch.Tensor:
    """mla_absorbed on a DeviceLenLatentCache: no host sync, no allocation that depends on the lengths, the same
    kernels as the MQA path above (only the decode grid is sized for entry.max_len). MQA only."""
    cfg = MLASpec.from_attrs(a)
    B, T, _ = x.shape
    if entry.batch != B:
        raise ValueError(f"MLA cache holds {entry.batch} sequences, the call has {B}")
    if _chosen(a, cache) == "mha":
        raise ValueError("a device-length MLA cache runs the MQA mode only (this call asks for MHA)")
    L = cfg.kv_lora_rank
    write_latent(x, w["kv_a_proj_with_mqa.weight"], w["kv_a_layernorm.weight"], a["lora_norm_eps"], entry.store,
                 entry.lens, L, binding=cache.ctx.binding)
    lens = entry.lens + T
    cache.layers[a["layer"]] = DeviceLenLatentCache(entry.store, lens, entry.max_len)
    cache.ctx.modes[a["layer"]] = "mqa"
    return _mqa_sublayer(a, x, ref.mla_query(x, w, cfg), w, entry.store, lens, entry.max_len, cache.ctx.binding)


KERNEL_IMPLS = {"mla_absorbed": launch_mla_absorbed}
TORCH_IMPLS = {"mla_kvb_split": torch_mla_kvb_split, "mla_absorbed": torch_mla_absorbed}

__all__ = ["PagedLatentCache", "DeviceLenLatentCache", "LatentStore", "new_store", "reserve", "write_latent",
           "mqa_decode", "mha_step", "DecodePlan", "mha_attention", "choose_mode", "choose_splits", "decode_splits",
           "split_kvb",
           "interleaved_block_table"]
