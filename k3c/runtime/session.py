"""A session: a compiled graph bound to weights on a device, with the caches of one batch of sequences.

    sess = model.session(w, device="cpu")
    logits = sess.prefill(input_ids)     # [B, T] -> [B, T, vocab]; starts a new batch
    logits = sess.decode(next_ids)       # [B] -> [B, vocab]
    logits = sess.append(segment_ids)    # [B, T'] -> [B, T', vocab]: append-prefill on the cached context
    new_ids = sess.generate(input_ids, max_new_tokens=16, sampling=SamplingParams(temperature=0.8, seed=1))
    text = sess.generate("import os\n", max_new_tokens=32)   # a model with a tokenizer: str in, str out
"""
from __future__ import annotations

import torch

from ..errors import ArgumentError
from .caches.context import CallContext
from .caches.latent_format import kv_format
from .executor import LayerCaches, build_graph_module
from .launcher import POLICIES, Binding
from .sampling import make_generator, params_for_rows, sample
from .weight_prep import prepare_weights


def bind_kernels(compiled, device: torch.device, policy: str = "artifact") -> Binding:
    """The Binding `compiled`'s kernels launch through on `device` (launcher.Binding), owned by the caller (a
    Session or Engine, through its graph) and carried to every launch by its call contexts: nothing is bound to
    the device, so models sharing it keep their own kernels. policy: "artifact" (a kernel the artifact lacks is
    JIT-compiled once, with a warning), "strict" (such a launch raises), "allow-jit" (an artifact for another
    target: JIT-compile the kernels for this device instead), "jit" (ignore the binaries: JIT everything). On a
    GPU a model with no artifact yet gets one compiled into the cache (CompiledModel.ensure_artifact); on a CPU the
    interpreter runs the kernels planned for the cpu target; on meta (nothing runs: a recording of the kernels
    launched) the model's own target is planned for."""
    from .devices import target_for

    if policy not in POLICIES:
        raise ArgumentError(f"kernel policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if device.type == "meta":
        return Binding(None, compiled.target, "jit")
    own = target_for(device)
    if device.type != "cuda":
        return Binding(None, own, "jit")          # Triton's interpreter: nothing is compiled
    tgt = compiled.target
    fits = tgt.backend == own.backend and tgt.arch == own.arch
    if policy == "jit" or (not fits and policy == "allow-jit"):
        return Binding(compiled.catalogue(), own, policy)      # kernels planned for the device itself
    if not fits:
        where = f"the artifact {compiled.artifact_dir}" if compiled.artifact_dir else "this model"
        raise ArgumentError(f"{where} is compiled for {tgt.name} ({tgt.backend} {tgt.arch}) and cannot run on "
                            f"{device} ({own.name}, {own.backend} {own.arch}): compile it with --target {own.name}, "
                            f"or pass --allow-jit to JIT-compile its kernels for this device")
    compiled.ensure_artifact()
    return Binding(compiled.catalogue(), tgt, policy)


def load_graph(compiled, weights: dict[str, torch.Tensor], device: torch.device, use_kernels: bool, *,
               wrap=None, kernel_policy: str = "artifact"):
    """The compiled graph with `weights` (checked against the IR's params) on `device`, holding the Binding its
    kernels launch through (`graph.binding`: bind_kernels under `kernel_policy`; without kernels, the device's
    own target with nothing bound). MLA ops take a mode a caller sets per call (`CallContext.mla_modes`);
    `wrap(op, fn)` may replace op implementations."""
    weights = prepare_weights(compiled.module, weights, compiled.spec)
    if use_kernels and device.type == "cpu":
        from ..codegen.triton_mode import prepare_interpreter

        prepare_interpreter()       # generated kernels run in Triton's interpreter on a CPU
    binding = bind_kernels(compiled, device, kernel_policy if use_kernels else "jit")
    on_device = {name: t.to(device) for name, t in weights.items()}
    return build_graph_module(compiled.module, on_device, use_kernels=use_kernels, wrap=wrap, binding=binding)


def describe_graph(compiled, use_kernels: bool) -> str:
    impls: dict[str, int] = {}
    for op in compiled.module.ops:
        impl = op.attr("impl", None)
        if impl is not None:
            impl = impl if (use_kernels or impl != "kernel") else "torch (kernels off)"
            impls[impl] = impls.get(impl, 0) + 1
    parts = ", ".join(f"{n} {k}" for k, n in sorted(impls.items())) or "no impl marks (codegen not run)"
    return f"torch.fx graph from the IR after {len(compiled.pass_names)} passes: {parts}"


def check_token_ids(ids, name: str = "input_ids") -> None:
    """ArgumentError unless `ids` is an integer tensor (not bool: an id tensor, not a mask)."""
    if not isinstance(ids, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ArgumentError(f"{name} must hold integer token ids, got dtype {str(ids.dtype).replace('torch.', '')}")


def _device(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ArgumentError(f"device must be a torch device such as cpu or cuda:0, got {device!r}") from None


class Session:
    def __init__(self, compiled, weights: dict[str, torch.Tensor], *, device: str = "cpu", max_batch: int = 8,
                 max_context: int | None = None, use_kernels: bool = True, kernel_policy: str = "artifact",
                 kv_dtype: str = "auto"):
        for name, v in (("max_batch", max_batch), ("max_context", max_context)):
            if (v is not None or name == "max_batch") and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ArgumentError(f"{name} must be a positive integer, got {v!r}")
        self.compiled = compiled
        self.spec = compiled.spec
        self.device = _device(device)
        self.max_batch = max_batch
        self.max_context = max_context or self.spec.max_context
        self.batch: int | None = None            # rows of the cached batch (set by prefill)
        self.use_kernels = use_kernels
        self.kv = kv_format(kv_dtype)                # the MLA latent cache's format (latent_format.KVFormat)
        self.graph = load_graph(compiled, weights, self.device, use_kernels, kernel_policy=kernel_policy)
        self.binding: Binding = self.graph.binding   # this session's kernels on its device (bind_kernels)
        self.cache: LayerCaches | None = None
        self.last_sampling: list = []            # the seeded SamplingParams per row of the last generate()

    def describe(self) -> str:
        return describe_graph(self.compiled, self.use_kernels)

    @property
    def last_modes(self) -> dict[int, str]:
        """MLA layer -> the mode ("mha" | "mqa") the cost model picked in the last call."""
        return dict(self.cache.ctx.modes) if self.cache else {}

    @property
    def length(self) -> int:
        return self.cache.length if self.cache else 0

    def _run(self, ids: torch.Tensor, cache: LayerCaches, check_ids: bool = True, name: str = "input_ids"
             ) -> torch.Tensor:
        check_token_ids(ids, name)
        if ids.dim() != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
            raise ArgumentError(f"{name} must be [B, T] with B, T >= 1, got {tuple(ids.shape)}")
        b, t = ids.shape
        if b > self.max_batch:
            raise ArgumentError(f"batch {b} exceeds the session's max_batch {self.max_batch}")
        if cache.length and self.batch is not None and b != self.batch:
            raise ArgumentError(f"{name} has {b} row(s) but the session caches a batch of {self.batch} (prefill a "
                                f"new batch to change its size)")
        if cache.length + t > self.max_context:
            raise ArgumentError(f"{cache.length} cached + {t} new tokens exceed max_context {self.max_context}")
        # one host read for both bounds (on a GPU each read is a device sync); generate's own argmax ids skip it
        if check_ids and bool(((ids < 0) | (ids >= self.spec.vocab_size)).any()):
            raise ArgumentError(f"{name}: token ids must be in [0, {self.spec.vocab_size})")
        work = cache.copy()          # a failed call leaves the session's cache untouched
        with torch.no_grad():
            logits = self.graph(ids.to(self.device), work)
        work.length = cache.length + t
        self.cache, self.batch = work, b
        return logits

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Start a new batch: logits [B, T, vocab] of the prompt."""
        return self._run(input_ids, LayerCaches(self.spec.num_layers, CallContext(self.binding, self.kv)))

    def append(self, segment_ids: torch.Tensor) -> torch.Tensor:
        """Append-prefill a segment [B, T'] after the cached context."""
        if self.cache is None:
            raise ArgumentError("append() needs a prefill first")
        return self._run(segment_ids, self.cache, name="segment_ids")

    def decode(self, next_ids: torch.Tensor) -> torch.Tensor:
        """One token per sequence: [B] -> logits [B, vocab]."""
        if self.cache is None:
            raise ArgumentError("decode() needs a prefill first")
        check_token_ids(next_ids, "next_ids")
        if next_ids.dim() != 1:
            raise ArgumentError(f"next_ids must be [B] (one token per sequence), got {tuple(next_ids.shape)}")
        return self._run(next_ids.reshape(-1, 1), self.cache, name="next_ids")[:, 0]

    def generate(self, prompt, max_new_tokens: int = 16, sampling=None):
        """Decoding: token ids [B, T] -> the new tokens [B, max_new_tokens]; with a tokenizer (CompiledModel.tokenizer)
        also a str -> its continuation (str), or a list of str -> theirs, each ending at the EOS token. `sampling`:
        one SamplingParams per row, or one for all (row i drawing from seed + i: sampling.params_for_rows); None:
        greedy. The seeded params are kept in `last_sampling`."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ArgumentError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt
                                       and all(isinstance(p, str) for p in prompt)):
            return self._generate_text(prompt, max_new_tokens, sampling)
        check_token_ids(prompt)
        rows = params_for_rows(sampling, prompt.shape[0] if prompt.dim() == 2 else 1)
        self.last_sampling = rows
        return self._decode_loop(prompt, max_new_tokens, rows)

    def _decode_loop(self, input_ids: torch.Tensor, max_new_tokens: int, rows: list, stop_id: int | None = None
                     ) -> torch.Tensor:
        """Prefill, then one token per row and step: [B, n] (n = max_new_tokens, or fewer when every row has
        emitted `stop_id`, which costs a host read per step; without it, greedy decoding never syncs)."""
        if input_ids.dim() == 2 and input_ids.shape[1] + max_new_tokens - 1 > self.max_context:
            raise ArgumentError(f"{input_ids.shape[1]} prompt + {max_new_tokens} new tokens exceed max_context "
                                f"{self.max_context}")
        generators = [make_generator(p) for p in rows]
        out = [sample(self.prefill(input_ids)[:, -1], rows, generators)]
        stopped = out[0] == stop_id if stop_id is not None else None
        for _ in range(max_new_tokens - 1):
            if stopped is not None and bool(stopped.all()):
                break
            # sampled ids are in range: no check (on a GPU, no sync per token)
            logits = self._run(out[-1].reshape(-1, 1), self.cache, check_ids=False)[:, 0]
            out.append(sample(logits, rows, generators))
            if stopped is not None:
                stopped |= out[-1] == stop_id
        return torch.stack(out, dim=1)

    def _generate_text(self, prompts, max_new_tokens: int, sampling):
        """generate() for text: prompts of equal token counts share a batch (at most max_batch rows each)."""
        tok = self.compiled.tokenizer
        if tok is None:
            raise ArgumentError("generate(): a str prompt needs the model's tokenizer, and this model has none "
                                "(compile it from a Hugging Face model directory with a tokenizer.json, or load "
                                "an artifact saved from one); pass token ids instead")
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = [tok.encode(t) for t in texts]
        empty = next((i for i, t in enumerate(ids) if not t), None)
        if empty is not None:
            raise ArgumentError(f"generate(): prompt {empty} encodes to no tokens")
        rows = params_for_rows(sampling, len(texts))
        self.last_sampling = rows
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(ids):
            groups.setdefault(len(t), []).append(i)
        out: list[str] = [""] * len(texts)
        for members in groups.values():
            for at in range(0, len(members), self.max_batch):
                chunk = members[at:at + self.max_batch]
                new = self._decode_loop(torch.tensor([ids[i] for i in chunk]), max_new_tokens,
                                        [rows[i] for i in chunk], tok.eos_id).tolist()
                for i, toks in zip(chunk, new):
                    if tok.eos_id in toks:
                        toks = toks[:toks.index(tok.eos_id)]
                    out[i] = tok.decode(toks)
        return out[0] if isinstance(prompts, str) else out
