"""Typed errors raised at arborlm's boundaries.

Every error a user can cause derives from `ArborError`, so callers can catch one
base class; the HTTP layer maps `InvalidRequestError` to a 400 response body in
OpenAI's shape. Internal invariants use `assert` instead.
"""


class ArborError(Exception):
    """Base class of every error arborlm raises on purpose."""


class InvalidRequestError(ArborError, ValueError):
    """A request that cannot be served as given (bad prompt, bad sampling field).

    Parameters
    ----------
    message:
        What is wrong and, where it helps, the accepted range.
    param:
        The offending field's name, e.g. ``"top_p"``; None when not one field.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt (+ an explicit `max_new_tokens`) exceed the model's context.

    `code` is OpenAI's error code for it, which HTTP answers carry.
    """

    code = "context_length_exceeded"


class ModelLoadError(ArborError):
    """A model path that does not exist or an architecture that is not supported."""


class RequestAbortedError(ArborError):
    """The request was aborted (by the client, by shutdown) before it finished."""


class ServerOverloadedError(ArborError):
    """More requests are in flight than `max_running_requests + max_queued_requests`.

    The HTTP server answers it with 503; the client may retry later.
    """


class EngineDeadError(ArborError):
    """The scheduler process exited; the engine cannot serve more requests."""


class SchedulerTimeoutError(ArborError):
    """The scheduler did not answer an info or flush request in time (a long or hung step).

    The engine is not known to be dead: the request may still take effect, and the
    scheduler's watchdog ends a loop that stays stuck. The HTTP server answers 503.
    """
