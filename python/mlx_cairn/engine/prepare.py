"""Request validation and tokenization, run on the caller's thread before any model work.

A large request (:data:`mlx_cairn.heavy.LARGE_BYTES` of text or more) is
rendered and tokenized under :data:`mlx_cairn.heavy.GATE`, so only a few run
at once, and one that cannot fit is refused on a cheap lower bound of its
size (:mod:`mlx_cairn.engine.prompt_bound`) before it is tokenized.
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import replace
from typing import Any

import orjson

from mlx_cairn import heavy
from mlx_cairn.chat.fim import fim_stop_ids, is_fim_prompt
from mlx_cairn.chat.prompt import build_raw_prompt, template_kwargs
from mlx_cairn.constrain.compile import compile_grammar, constrained
from mlx_cairn.engine.prompt_bound import vocab_bound
from mlx_cairn.engine.request import PreparedRequest
from mlx_cairn.errors import ContextLengthExceeded, InvalidRequest
from mlx_cairn.models.loaded import vocab_size
from mlx_cairn.text import output_family
from mlx_cairn.types import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_SEQUENCE_CHARS,
    MAX_STOP_SEQUENCES,
    SAMPLING_BOUNDS,
    ChatRequest,
    RawPrompt,
    SamplingParams,
)


def validate_sampling(s: SamplingParams) -> SamplingParams:
    """Check every setting against :data:`~mlx_cairn.types.SAMPLING_BOUNDS`; resolve a
    missing seed to a random one."""

    def check(name: str, v: Any, param: str | None = None, label: str | None = None) -> None:
        bound = SAMPLING_BOUNDS[name]
        if not bound.holds(v):
            raise InvalidRequest(
                f"{label or name} must be {bound.describe()}, got {v!r}", param=param or name
            )

    for name in _SCALAR_SETTINGS:
        check(name, getattr(s, name))
    if not isinstance(s.logit_bias, dict) or len(s.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(
            f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to numbers",
            param="logit_bias",
        )
    for tid, v in s.logit_bias.items():
        if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
            raise InvalidRequest(
                f"logit_bias keys must be token ids, got {tid!r}", param="logit_bias"
            )
        check("logit_bias", v, label="logit_bias values")
    check("top_logprobs", s.top_logprobs)
    seed = s.seed
    if seed is None:
        seed = secrets.randbits(63)
    else:
        check("seed", seed)
    return replace(s, seed=seed)


#: The settings checked one by one, in the order a refusal names the first bad one.
_SCALAR_SETTINGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


def render(
    loaded: Any,
    request: ChatRequest,
    *,
    limit: int | None = None,
    what: str = "the model's context",
) -> Any:
    """Render ``request`` through the chat template and tokenize it.

    Without ``limit`` nothing is checked: the prompt is counted exactly,
    however long (``count_tokens``). With ``limit``, a large request whose
    rendered text alone proves more than ``limit`` tokens raises
    ContextLengthExceeded before it is tokenized; its ``prompt_tokens`` is
    that proven lower bound (exact counts are kept for the prompts that are
    tokenized, which every prompt under ``LARGE_BYTES`` is).

    Large requests run on :data:`mlx_cairn.heavy.GATE` (QueueFull when too
    many threads wait for it); small ones go straight through.
    """
    _check_prompt_given(request)
    if not heavy.is_large(request_text_size(request)):
        return _render(loaded, request)
    return heavy.GATE.call(_render_large, loaded, request, limit, what)


def _render_large(loaded: Any, request: ChatRequest, limit: int | None, what: str) -> Any:
    if limit is not None:
        bound = vocab_bound(loaded.tokenizer)
        if bound is not None:
            n = bound.lower_bound(_render(loaded, request, text_only=True))
            if n > limit:
                raise ContextLengthExceeded(prompt_tokens=n, limit=limit, what=what)
    return _render(loaded, request)


def _render(loaded: Any, request: ChatRequest, *, text_only: bool = False) -> Any:
    """The Prompt of ``request``, or with ``text_only`` just its text (not tokenized)."""
    raw = request.raw
    if raw is not None:
        if text_only:
            return raw.text + (raw.suffix or "") + "".join(c.get("text", "") for c in raw.extra)
        return _raw_prompt(loaded, raw)
    try:
        if not text_only:
            return loaded.prompt(request)
        # The text build_prompt renders (tools only when they may be called).
        tools = request.tools if request.offers_tools else None
        return loaded.template.render(
            request.messages,
            tools,
            add_generation_prompt=True,
            **template_kwargs(request, loaded.reasoning),
        )
    except (InvalidRequest, ContextLengthExceeded):
        raise
    except Exception as e:
        raise InvalidRequest(f"could not render the chat template: {e}", param="messages") from e


def _check_prompt_given(request: ChatRequest) -> None:
    if request.raw is not None:
        if request.messages:
            raise InvalidRequest("a raw prompt takes no messages", param="messages")
    elif not request.messages:
        raise InvalidRequest("messages must not be empty", param="messages")


def _raw_prompt(loaded: Any, raw: RawPrompt) -> Any:
    """The Prompt of a raw (template-free) request; client token ids must be in the vocabulary."""
    if raw.ids is not None:
        vocab = vocab_size(loaded)
        bad = next((t for t in raw.ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})",
                param="prompt",
            )
    prompt = build_raw_prompt(raw, loaded.tokenizer)
    if not prompt.ids:
        raise InvalidRequest("the prompt is empty (no tokens)", param="prompt")
    return prompt


def request_text_size(request: ChatRequest) -> int:
    """About how many characters of text ``request`` brings to its prompt (cheap: no render)."""
    n = 0
    if request.raw is not None:
        raw = request.raw
        n += len(raw.text) + len(raw.suffix or "") + len(raw.ids or ())
        n += sum(len(c.get("text", "")) + len(c.get("filename", "")) for c in raw.extra)
    for m in request.messages:
        n += len(m.content) + len(m.reasoning or "") + len(m.name or "")
        n += sum(len(c.name) + len(c.arguments) for c in m.tool_calls)
    for t in request.tools:
        n += len(t.name) + len(t.description)
        with contextlib.suppress(TypeError):
            n += len(orjson.dumps(t.parameters))
    for v in request.template_kwargs.values():
        if isinstance(v, str):
            n += len(v)
    return n


def prepare(
    loaded: Any,
    request: ChatRequest,
    *,
    context_length: int,
    max_tokens_capacity: int,
    clamp_max_tokens: bool = False,
) -> PreparedRequest:
    """Validate ``request``, render its prompt, and check it fits the context and the KV pool.

    With ``clamp_max_tokens`` a prompt that fits but leaves less room than
    ``max_tokens`` gets the room that is left instead of an error.
    """
    _check_prompt_given(request)
    mt = request.max_tokens
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise InvalidRequest(
            f"max_tokens must be a positive integer, got {mt!r}", param="max_tokens"
        )
    if not isinstance(request.stop, list) or len(request.stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"stop must be a list of at most {MAX_STOP_SEQUENCES} strings", param="stop"
        )
    for s in request.stop:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_SEQUENCE_CHARS:
            raise InvalidRequest(
                f"each stop sequence must be a non-empty string of at most {MAX_STOP_SEQUENCE_CHARS} characters",
                param="stop",
            )
    sampling = validate_sampling(request.sampling)
    if sampling.logit_bias:
        vocab = vocab_size(loaded)
        for tid in sampling.logit_bias:
            if tid >= vocab:
                raise InvalidRequest(
                    f"logit_bias token id {tid} is outside the vocabulary (0..{vocab - 1})",
                    param="logit_bias",
                )
    limit = min(context_length, max_tokens_capacity)
    what = (
        "the model's context"
        if limit == context_length
        else "the KV cache capacity; start the server with a larger KV cache"
    )
    prompt = render(loaded, request, limit=limit, what=what)
    n = len(prompt.ids)
    if n == 0:
        raise InvalidRequest("the rendered prompt is empty", param="messages")
    if n > limit:
        raise ContextLengthExceeded(prompt_tokens=n, limit=limit, what=what)
    if clamp_max_tokens and limit - n < mt:
        mt = max(limit - n, 1)  # a prompt that fills the context still fails below
    if n + mt > limit:
        raise ContextLengthExceeded(prompt_tokens=n, limit=limit, max_tokens=mt, what=what)
    info = loaded.reasoning
    # A raw prompt's output is plain text: the model continues the client's own prompt.
    raw = request.raw is not None
    reasoning = bool(info.supported and (request.reasoning is not False)) and not raw
    budget = request.reasoning_budget
    if budget is not None and (
        not isinstance(budget, int) or isinstance(budget, bool) or budget < 1
    ):
        raise InvalidRequest(
            f"reasoning budget must be a positive integer, got {budget!r}", param="thinking"
        )
    tags: tuple[list[int], list[int]] = ([], [])
    if reasoning and budget is not None:
        tok = loaded.tokenizer
        tags = (tok.encode(info.open_tag), tok.encode(info.close_tag))
    tools_on = request.offers_tools
    grammar = compile_grammar(loaded, request) if constrained(request) else None
    after: list[int] = []
    if grammar is not None and reasoning and prompt.in_reasoning:
        after = loaded.tokenizer.encode(info.close_tag)
    return PreparedRequest(
        request=request,
        prompt_ids=list(prompt.ids),
        last_user_at=prompt.last_user_at,
        parser_family=None if raw else output_family(loaded.parser_family, tools_on),
        reasoning=reasoning,
        in_reasoning=bool(prompt.in_reasoning),
        salt=f"{loaded.identity}\x00{request.cache_salt or ''}",
        max_tokens=mt,
        sampling=sampling,
        reasoning_budget=budget if reasoning else None,
        reasoning_tags=tags,
        grammar=grammar,
        grammar_after=after,
        stop_token_ids=_fim_stop_ids(loaded, request, prompt.ids),
        media=getattr(prompt, "media", None),
    )


def _fim_stop_ids(loaded: Any, request: ChatRequest, ids: list[int]) -> frozenset[int]:
    """A fill-in-the-middle request also ends at the model's end-of-middle tokens:
    one with a suffix, and a raw prompt the client built with the FIM tokens
    itself (Continue, Zed and Twinny send ``<|fim_prefix|>...`` as the prompt)."""
    raw = request.raw
    if raw is None:
        return frozenset()
    if raw.suffix is None and not is_fim_prompt(loaded.tokenizer, ids):
        return frozenset()
    return frozenset(fim_stop_ids(loaded.tokenizer))
