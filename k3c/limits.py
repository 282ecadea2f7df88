"""Upper bounds of every size a user can ask for, in one place: the CLI checks them at parse time and the APIs
(plan, run) check them again, so no command starts work or memory it cannot finish. They are far above any real
K3 deployment (1M-token contexts, TP8 x EP64) and far below what would exhaust a machine before an estimate runs.
"""
from __future__ import annotations

MAX_TOKENS = 2 ** 31          # --context, --prompt-len, --new-tokens, --prefill-chunk
MAX_BATCH = 2 ** 24           # --batch (sequences)
MAX_RANKS = 2 ** 16           # --tp, --ep
MAX_STAGES = 1024             # --pp, --vpp
MAX_SEED = 2 ** 63 - 1        # --seed: [0, 2**63 - 1], what torch.Generator.manual_seed takes without wrapping
MAX_JSON_DEPTH = 64           # nesting of a JSON file k3c reads (a manifest, a config, an index)
MAX_TOP_K = 2 ** 31           # --top-k, the API's top_k: past the vocabulary means the vocabulary
