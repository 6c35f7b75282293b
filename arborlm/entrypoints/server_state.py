"""What one server holds: settings, model facts, the scheduler process, the
tokenizer manager and the metrics. The app keeps one `ServerState` in
`app.state.arbor`; routes read it from the request (no module-level state).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from arborlm.entrypoints.http_errors import APIError
from arborlm.entrypoints.metrics import ServerMetrics
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.io_struct import ModelInfo
from arborlm.runtime.launcher import SchedulerProcess
from arborlm.runtime.tokenizer_manager import TokenizerManager

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Accepted as a model name whatever the served model is (SGLang's examples use it).
MODEL_ALIAS = "default"


def served_model_name(server_args: ServerArgs) -> str:
    """The name the OpenAI API reports: `served_model_name`, else the model path as given."""
    return server_args.server.served_model_name or server_args.model.model_path or DEFAULT_MODEL_NAME


@dataclass
class ServerState:
    """One server's state; `manager` is set once the app's loop runs (lifespan startup)."""

    server_args: ServerArgs
    model_info: ModelInfo
    tokenizer: Any
    scheduler: SchedulerProcess
    metrics: ServerMetrics
    manager: TokenizerManager | None = None
    shutting_down: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return served_model_name(self.server_args)

    def accepts_model(self, name: str | None) -> bool:
        """True for None (not given), the served name, its last path component, or "default"."""
        if name is None or name in (self.model_name, MODEL_ALIAS):
            return True
        return name == os.path.basename(os.path.normpath(self.model_name))

    def check_model(self, name: str | None) -> None:
        """Raise OpenAI's 404 `model_not_found` for a model this server does not serve."""
        if not self.accepts_model(name):
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def live_manager(self) -> TokenizerManager:
        """The manager, if the server still takes requests.

        Raises
        ------
        APIError: 503 while starting or shutting down.
        """
        if self.manager is None or self.shutting_down:
            raise APIError(503, "the server is shutting down" if self.shutting_down else "the server is starting",
                           type="server_error", code="unavailable")
        return self.manager


def get_state(request: Request) -> ServerState:
    return request.app.state.arbor
