"""`k3c serve`: an OpenAI-compatible HTTP server over the serving engine (docs/runtime.md, "Serving over HTTP").

    protocol.py     request bodies -> GenerationRequest (checked; APIError with an OpenAI-style body otherwise)
    chat.py         chat messages -> prompt text (the model directory's chat template, or the plain default)
    text_stream.py  generated ids -> text deltas: incremental decoding, stop strings held back until decided
    engine_loop.py  the one thread that owns the engine: handlers enqueue jobs, it steps and hands out tokens
    metrics.py      Prometheus counters, histograms and gauges of one server
    app.py          the Starlette app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
    connection.py   uvicorn's HTTP/1.1 protocol with a header timeout (slow clients are cut off)
"""
