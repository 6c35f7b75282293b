"""How users enter arborlm: the in-process `Engine` and the HTTP server.

`engine.py` is the in-process entry point (what `sgl.Engine` is);
`http_server.py` builds the FastAPI app with SGLang's native routes
(`native_api.py`) and the OpenAI-compatible routes (`openai/`);
`launch_server.py` is what `arborlm serve` runs. Both entry points build
requests through `request_builder.py` and hand them to the runtime's
`TokenizerManager`, which talks to the scheduler process over zmq.
"""
