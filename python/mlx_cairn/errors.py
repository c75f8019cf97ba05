"""Typed errors raised before a stream starts; the API maps each to a status.

=====================  ======  =========================  ===================
exception              status  Anthropic type             OpenAI type
=====================  ======  =========================  ===================
InvalidRequest         400     invalid_request_error      invalid_request_error
ContextLengthExceeded  400     invalid_request_error      invalid_request_error
ModelNotFound          404     not_found_error            not_found_error
QueueFull              429     rate_limit_error           rate_limit_error
ModelLoadError         500     api_error                  server_error
EngineError            500     api_error                  server_error
=====================  ======  =========================  ===================
"""

from __future__ import annotations


class CairnError(Exception):
    """Base class; ``kind`` names the error in the Event stream."""

    kind = "internal"
    status = 500

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(CairnError):
    kind = "invalid_request"
    status = 400


class ContextLengthExceeded(InvalidRequest):
    """Prompt + max_tokens do not fit; ``room`` is how many new tokens would
    (the context or the KV pool, whichever is smaller, less the prompt)."""

    kind = "context_length"

    def __init__(self, message: str, *, param: str | None = None, room: int | None = None):
        super().__init__(message, param=param)
        self.room = room


class ModelNotFound(CairnError):
    kind = "not_found"
    status = 404


class QueueFull(CairnError):
    kind = "overloaded"
    status = 429

    def __init__(self, message: str = "the request queue is full", *, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class ModelLoadError(CairnError):
    kind = "model_load"
    status = 500


class EngineError(CairnError):
    kind = "internal"
    status = 500
