"""Typed errors, and the one table that maps every error kind to its status and types.

Every error the server sends, in any dialect, is looked up here by its kind:
a :class:`CairnError` raised before a response starts, an ``Error`` event that
ends a generation, or an HTTP-level refusal (401 from the auth gate, 413, 404
for an unknown path). The kinds:

================  ======  =========================  =====================  =======================
kind              status  Anthropic type             OpenAI type            OpenAI code
================  ======  =========================  =====================  =======================
invalid_request   400     invalid_request_error      invalid_request_error
context_length    400     invalid_request_error      invalid_request_error  context_length_exceeded
authentication    401     authentication_error       authentication_error   invalid_api_key
permission        403     permission_error           permission_error
not_found         404     not_found_error            not_found_error
method            405     invalid_request_error      invalid_request_error
timeout           408     invalid_request_error      invalid_request_error  request_timeout
too_large         413     request_too_large          invalid_request_error  request_too_large
rate_limit        429     rate_limit_error           rate_limit_error       rate_limit_exceeded
overloaded        529     overloaded_error           server_error           overloaded
unavailable       503     overloaded_error           server_error           model_unavailable
internal          500     api_error                  server_error
model_load        500     api_error                  server_error
not_supported     501     api_error                  invalid_request_error  not_supported
================  ======  =========================  =====================  =======================

A kind not in the table is ``internal``. A full request queue is
``rate_limit`` (429 with ``Retry-After``: clients back off and retry); a model
that cannot be loaded because nothing can be unloaded is ``unavailable`` (503
with ``Retry-After``). A route this server knows but does not serve (the Ollama
API's model management: pull, push, create, ...) is ``not_supported``: 501,
which no client retries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ErrorKind:
    """How one kind of error is answered."""

    status: int
    anthropic: str
    openai: str
    openai_code: str | None = None


ERROR_KINDS: dict[str, ErrorKind] = {
    "invalid_request": ErrorKind(400, "invalid_request_error", "invalid_request_error"),
    "context_length": ErrorKind(
        400, "invalid_request_error", "invalid_request_error", "context_length_exceeded"
    ),
    "authentication": ErrorKind(
        401, "authentication_error", "authentication_error", "invalid_api_key"
    ),
    "permission": ErrorKind(403, "permission_error", "permission_error"),
    "not_found": ErrorKind(404, "not_found_error", "not_found_error"),
    "method": ErrorKind(405, "invalid_request_error", "invalid_request_error"),
    "timeout": ErrorKind(408, "invalid_request_error", "invalid_request_error", "request_timeout"),
    "too_large": ErrorKind(413, "request_too_large", "invalid_request_error", "request_too_large"),
    "rate_limit": ErrorKind(429, "rate_limit_error", "rate_limit_error", "rate_limit_exceeded"),
    "overloaded": ErrorKind(529, "overloaded_error", "server_error", "overloaded"),
    "unavailable": ErrorKind(503, "overloaded_error", "server_error", "model_unavailable"),
    "internal": ErrorKind(500, "api_error", "server_error"),
    "model_load": ErrorKind(500, "api_error", "server_error"),
    "not_supported": ErrorKind(501, "api_error", "invalid_request_error", "not_supported"),
}


#: ``what`` of a ContextLengthExceeded whose limit is the model's own context.
_CONTEXT = "the model's context"


def error_kind(kind: str) -> ErrorKind:
    """The table row of ``kind`` (``internal`` for kinds not in the table)."""
    return ERROR_KINDS.get(kind) or ERROR_KINDS["internal"]


def kind_for_status(status: int) -> str:
    """The kind of an HTTP-level refusal that carries only a status (e.g. from Starlette)."""
    for kind, row in ERROR_KINDS.items():
        if row.status == status:
            return kind
    return "internal" if status >= 500 else "invalid_request"


class CairnError(Exception):
    """Base class; ``kind`` names the error in the Event stream."""

    kind = "internal"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def status(self) -> int:
        """The HTTP status of this error's kind (:data:`ERROR_KINDS`)."""
        return error_kind(self.kind).status

    def message_for(self, dialect: str) -> str:
        """The message in the words clients of ``dialect`` (a Dialect name) act on."""
        return self.message


class InvalidRequest(CairnError):
    kind = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    """The prompt, or prompt + max_tokens, does not fit in ``limit`` tokens.

    ``room`` is how many new tokens would fit (``limit`` less the prompt).
    The message is in the words clients act on, per dialect:

    - Anthropic: ``prompt is too long: N tokens > M maximum`` when the prompt
      alone is too long (Claude Code compacts its conversation on it; keep
      it word for word);
    - OpenAI (:meth:`message_for`): OpenAI's own sentence, ``This model's
      maximum context length is M tokens. However, ...`` (litellm maps it to
      ContextWindowExceededError), which also says ``prompt is too long``
      and names the code ``context_length_exceeded``: the openai SDK puts
      only the message in ``str(error)``, and langchain looks for either
      phrase there.

    ``prompt_param`` / ``max_tokens_param`` are the request fields the
    message and ``param`` name (:meth:`named`: ``input`` and
    ``max_output_tokens`` in Responses, ``max_completion_tokens`` when a
    chat request sent that).
    """

    kind = "context_length"

    def __init__(
        self,
        *,
        prompt_tokens: int,
        limit: int,
        max_tokens: int | None = None,
        what: str = _CONTEXT,
        advise_clamp: bool = False,
        prompt_param: str = "messages",
        max_tokens_param: str = "max_tokens",
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        self.max_tokens = max_tokens
        self.what = what
        self.advise_clamp = advise_clamp
        self.prompt_param = prompt_param
        self.max_tokens_param = max_tokens_param
        self.room = limit - prompt_tokens
        mt = max_tokens_param
        if max_tokens is None:
            message = f"prompt is too long: {prompt_tokens} tokens > {limit} maximum"
            param = prompt_param
        else:
            message = (
                f"prompt ({prompt_tokens} tokens) + {mt} ({max_tokens}) = "
                f"{prompt_tokens + max_tokens} tokens > {limit} maximum ({what})"
            )
            param = mt
        if self._advice():
            message += f"; {self._advice()}"
        super().__init__(message, param=param)

    def _advice(self) -> str:
        if not (self.advise_clamp and self.max_tokens is not None):
            return ""
        return (
            f"lower {self.max_tokens_param} to at most {self.room}, or start the server "
            "with --clamp-max-tokens to generate up to the context instead"
        )

    def _replace(self, **changes: Any) -> ContextLengthExceeded:
        fields = {
            "prompt_tokens": self.prompt_tokens,
            "limit": self.limit,
            "max_tokens": self.max_tokens,
            "what": self.what,
            "advise_clamp": self.advise_clamp,
            "prompt_param": self.prompt_param,
            "max_tokens_param": self.max_tokens_param,
        }
        return ContextLengthExceeded(**(fields | changes))

    def with_clamp_advice(self) -> ContextLengthExceeded:
        """The same error, advising a lower max_tokens or ``--clamp-max-tokens`` (every dialect)."""
        return self._replace(advise_clamp=True)

    def named(self, prompt_param: str, max_tokens_param: str) -> ContextLengthExceeded:
        """The same error naming the request's own fields (``param`` and message)."""
        return self._replace(prompt_param=prompt_param, max_tokens_param=max_tokens_param)

    def message_for(self, dialect: str) -> str:
        if not dialect.startswith("openai"):
            return self.message
        n, p, mt = self.prompt_tokens, self.prompt_param, self.max_tokens_param
        where = "" if self.what == _CONTEXT else f" ({self.what})"
        head = f"This model's maximum context length is {self.limit} tokens{where}. However, "
        if self.max_tokens is None:
            body = (
                f"your {p} resulted in {n} tokens: the prompt is too long. "
                f"Please reduce the length of the {p}"
            )
        else:
            body = (
                f"you requested {n + self.max_tokens} tokens ({n} in the {p}, "
                f"{self.max_tokens} for {mt}): the prompt is too long to leave room for "
                f"{mt}. Please reduce the length of the {p}, or "
                + (self._advice() or f"lower {mt}")
            )
        return f"{head}{body}. (code: {error_kind(self.kind).openai_code})"


class ModelNotFound(CairnError):
    kind = "not_found"


class QueueFull(CairnError):
    kind = "rate_limit"

    def __init__(self, message: str = "the request queue is full", *, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class ModelLoadError(CairnError):
    kind = "model_load"


class ModelUnavailable(CairnError):
    """A model cannot be loaded now: no room, and every loaded model is pinned or busy."""

    kind = "unavailable"

    def __init__(self, message: str, *, retry_after: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NotSupported(CairnError):
    """A known route or feature this server does not provide (501)."""

    kind = "not_supported"


class EngineError(CairnError):
    kind = "internal"


class KVPoolSizeError(ValueError):
    """A KV pool that cannot be sized as asked: too few blocks for any request, or
    more than the available memory (``engine/paged.py``). A ValueError, as every
    bad engine setting is; ``cairn serve`` names the ``--kv-cache-gb`` it came from."""
