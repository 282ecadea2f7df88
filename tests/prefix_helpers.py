"""The small engine the prefix-cache and KV-tier tests drive (k3-tiny, torch ops, pages of 8 rows), random prompts,
and serving one request to the end."""
import torch

from k3c.runtime.engine import Engine


def engine(tiny, prefix=None, **kw):
    spec, model, w = tiny
    return Engine(model, w, use_kernels=False, max_context=96, page_size=8, max_batch=4, prefix_cache=prefix, **kw)


def toks(spec, n, seed):
    return torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(eng, prompt, new):
    """Add one request and step the engine until nothing is left: (its SeqState, its StepOutputs)."""
    rid = eng.add_request(prompt, new)
    seq = eng.seqs[rid]
    outs = []
    while eng.has_work():
        outs += [o for o in eng.step() if o.rid == rid]
    return seq, outs
