"""The HTTP server: SGLang's native API and the OpenAI-compatible API on FastAPI + uvicorn.

The tokenizer manager runs on uvicorn's event loop in the HTTP process; the
scheduler (model, pools, radix cache) runs in its own process behind zmq, the
same one the in-process `Engine` starts (`arborlm.runtime.launcher`).
`launch_server` is what `arborlm serve` runs.
"""

from arborlm.runtime.server.app import create_app
from arborlm.runtime.server.launch import launch_server

__all__ = ["create_app", "launch_server"]
