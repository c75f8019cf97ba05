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

    def message_for(self, dialect: str) -> str:
        """The message in the words clients of ``dialect`` (a Dialect name) act on."""
        return self.message


class InvalidRequest(CairnError):
    kind = "invalid_request"
    status = 400


class ContextLengthExceeded(InvalidRequest):
    """The prompt, or prompt + max_tokens, does not fit in ``limit`` tokens.

    ``room`` is how many new tokens would fit (``limit`` less the prompt).
    The message is in the words clients act on: Anthropic clients (Claude
    Code compacts its conversation on it) read ``prompt is too long: N tokens
    > M maximum`` when the prompt alone is too long; OpenAI clients (litellm
    maps it to ContextWindowExceededError) read ``maximum context length is M
    tokens``.
    """

    kind = "context_length"

    def __init__(
        self,
        *,
        prompt_tokens: int,
        limit: int,
        max_tokens: int | None = None,
        what: str = "the model's context",
        hint: str = "",
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        self.max_tokens = max_tokens
        self.what = what
        self.hint = hint
        self.room = limit - prompt_tokens
        if max_tokens is None:
            message = f"prompt is too long: {prompt_tokens} tokens > {limit} maximum"
            param = "messages"
        else:
            message = (
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{prompt_tokens + max_tokens} tokens > {limit} maximum ({what})"
            )
            param = "max_tokens"
        super().__init__(message + hint, param=param)

    def with_hint(self, hint: str) -> ContextLengthExceeded:
        """The same error with ``hint`` appended to its message (every dialect)."""
        return ContextLengthExceeded(
            prompt_tokens=self.prompt_tokens,
            limit=self.limit,
            max_tokens=self.max_tokens,
            what=self.what,
            hint=self.hint + hint,
        )

    def message_for(self, dialect: str) -> str:
        if not dialect.startswith("openai"):
            return self.message
        completion = self.max_tokens or 0
        return (
            f"This model's maximum context length is {self.limit} tokens. However, you "
            f"requested {self.prompt_tokens + completion} tokens ({self.prompt_tokens} in the "
            f"messages, {completion} in the completion). Please reduce the length of the "
            f"messages or completion.{self.hint}"
        )


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
