"""The serving engine's rooms (docs/runtime.md, "Who owns what"). Lowest first: requests (StepOutput, request
checks) < ledger (page reference counts and page lists) < scheduler (admission, preemption, segments) < graph_pool
(captured decode graphs, KDA slot homes) < runner (graph calls, the MLA mode choice) < speculation (drafts,
verification, rollback) < engine (the facade: add_request, finish, step, generate, stats)."""
