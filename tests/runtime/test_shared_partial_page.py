"""Two sequences writing one shared partial MLA page in the same call (PageLedger.needs): the second copies it.

A request whose prompt extends a running request's prompt resumes from that request's prompt-end checkpoint and so
holds its last, partly filled page; in the next step both write the same row of it (the running one its first
generated token, the resumed one the rest of its prompt). Found by `k3c serve`'s load test (requests
arriving while others run): the resumed sequence overwrote its neighbour's row and both continued differently.
"""
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_resumed_sequence_does_not_share_the_row_it_writes():
    from k3c.commands.run import _graph_weights, _load_model
    from k3c.runtime.engine import Engine
    from k3c.runtime.prefix_cache import PrefixCache

    model = _load_model(str(ROOT / "examples" / "k3-stdlib"))
    w, _ = _graph_weights(model, str(ROOT / "examples" / "k3-stdlib"), 0, torch.float32, "cpu", lambda: None)
    prompt = model.tokenizer.encode("import os\nimport sys\n\n\ndef main():\n    ")
    assert len(prompt) % 64                                   # ends inside a page
    solo = Engine(model, w, device="cpu", max_batch=4, max_context=128, use_kernels=False)
    alone = solo.generate([prompt], 12)[0]
    longer = prompt + [t for t in model.tokenizer.encode("x = 1\n") if t != alone[0]]   # another row than A's
    alone_longer = solo.generate([longer], 12)[0]
    cache = PrefixCache()
    eng = Engine(model, w, device="cpu", max_batch=4, max_context=128, use_kernels=False, prefix_cache=cache)
    first = eng.add_request(prompt, 12)
    got = {first: [o.token for o in eng.step()]}              # prefilled, checkpointed at its prompt end
    second = eng.add_request(longer, 12)                      # resumes from that checkpoint: the same last page
    got[second] = []
    while eng.has_work():
        for o in eng.step():
            got[o.rid].append(o.token)
    assert cache.stats["hits"] == 1
    assert got[first] == alone and got[second] == alone_longer
    cache.clear()
    eng.pool.check_empty()
