"""`k3c serve`: an OpenAI-compatible HTTP server over the serving engine (docs/runtime.md, "Serving over HTTP").

    api_error.py    OpenAI's error object (APIError) and the 400 naming a field
    protocol.py     request bodies -> GenerationRequest (checked; APIError with an OpenAI-style body otherwise)
    tools.py        tools, tool_choice, response_format checked; the grammar they call for
    grammar.py      constrained decoding over xgrammar: JSON schemas, JSON objects, forced K2 tool calls
    tool_parser.py  generated text -> content, reasoning_content and K2 tool calls, incrementally
    chat.py         chat messages -> prompt text (the model directory's template; else K2's with tools, or plain)
    loading.py      503 on the socket while the model loads
    text_stream.py  generated ids -> text deltas: incremental decoding, stop strings held back until decided
    engine_loop.py  the one thread that owns the engine: handlers enqueue jobs, it steps and hands out tokens
    metrics.py      Prometheus counters, histograms and gauges of one server
    app.py          the Starlette app: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
                    /health, /metrics
    connection.py   uvicorn's HTTP/1.1 protocol with a header timeout (slow clients are cut off)
"""
