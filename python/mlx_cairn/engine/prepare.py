"""Request validation and tokenization, run on the caller's thread before any model work.

A large request (:data:`mlx_cairn.heavy.LARGE_BYTES` of text or more) is
rendered and tokenized under :data:`mlx_cairn.heavy.GATE`, so only a few run
at once, and one that cannot fit is refused on a cheap lower bound of its
size (:mod:`mlx_cairn.engine.prompt_bound`) before it is tokenized.
"""

from __future__ import annotations

import contextlib
import math
import secrets
from dataclasses import replace
from typing import Any

import orjson

from mlx_cairn import heavy
from mlx_cairn.chat.fim import fim_stop_ids, is_fim_prompt
from mlx_cairn.chat.prompt import build_raw_prompt, template_kwargs
from mlx_cairn.engine.prompt_bound import vocab_bound
from mlx_cairn.engine.request import PreparedRequest
from mlx_cairn.errors import ContextLengthExceeded, InvalidRequest
from mlx_cairn.text import output_family
from mlx_cairn.types import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_SEQUENCE_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    MIN_SEED,
    ChatRequest,
    RawPrompt,
    SamplingParams,
)


def validate_sampling(s: SamplingParams) -> SamplingParams:
    """Check ranges; resolve a missing seed to a random one."""

    def bad(param: str, msg: str) -> InvalidRequest:
        return InvalidRequest(msg, param=param)

    if not _finite(s.temperature) or s.temperature < 0:
        raise bad("temperature", f"temperature must be a finite number >= 0, got {s.temperature!r}")
    if not _finite(s.top_p) or not 0 < s.top_p <= 1:
        raise bad("top_p", f"top_p must be in (0, 1], got {s.top_p!r}")
    if not isinstance(s.top_k, int) or isinstance(s.top_k, bool) or not 0 <= s.top_k <= MAX_TOP_K:
        raise bad("top_k", f"top_k must be an integer in [0, {MAX_TOP_K}], got {s.top_k!r}")
    if not _finite(s.min_p) or not 0 <= s.min_p <= 1:
        raise bad("min_p", f"min_p must be in [0, 1], got {s.min_p!r}")
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(s, name)
        if not _finite(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
            raise bad(name, f"{name} must be in [{-MAX_PENALTY}, {MAX_PENALTY}], got {v!r}")
    rp = s.repetition_penalty
    if not _finite(rp) or not 0 < rp <= MAX_REPETITION_PENALTY:
        raise bad(
            "repetition_penalty",
            f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {rp!r}",
        )
    if not isinstance(s.logit_bias, dict) or len(s.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad(
            "logit_bias",
            f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to numbers",
        )
    for tid, v in s.logit_bias.items():
        if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
            raise bad("logit_bias", f"logit_bias keys must be token ids, got {tid!r}")
        if not _finite(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise bad(
                "logit_bias",
                f"logit_bias values must be in [{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {v!r}",
            )
    k = s.top_logprobs
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad(
            "top_logprobs", f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r}"
        )
    seed = s.seed
    if seed is None:
        seed = secrets.randbits(63)
    elif not isinstance(seed, int) or isinstance(seed, bool) or not MIN_SEED <= seed <= MAX_SEED:
        raise bad("seed", f"seed must be a 64-bit integer, got {seed!r}")
    return replace(s, seed=seed)


def vocab_size(loaded: Any) -> int:
    """Width of the model's logits (the model's vocabulary, padding included)."""
    for owner in (loaded.model, getattr(loaded.model, "args", None)):
        n = getattr(owner, "vocab_size", None)
        if isinstance(n, int) and n > 0:
            return n
    return int(loaded.tokenizer.vocab_size)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


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
    grammar = compile_grammar(loaded, request) if _constrained(request) else None
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


def _forced_tools(request: ChatRequest) -> list[Any] | None:
    """The tools one of which must be called, or None when no call is forced."""
    choice = request.tool_choice
    if not request.offers_tools or choice in (None, "auto"):
        return None
    if choice == "required":
        return list(request.tools)
    if isinstance(choice, dict):
        named = [t for t in request.tools if t.name == choice.get("name")]
        if not named:
            raise InvalidRequest(
                f"tool_choice names {choice.get('name')!r}, which is not among the tools",
                param="tool_choice",
            )
        return named
    return None


def _constrained(request: ChatRequest) -> bool:
    strict = request.offers_tools and any(t.strict for t in request.tools)
    return strict or request.output_format is not None or _forced_tools(request) is not None


def compile_grammar(loaded: Any, request: ChatRequest) -> Any:
    """The request's grammar, compiled (InvalidRequest naming what does not compile).

    A forced tool call follows the family's tool-call syntax; a structured
    output follows its schema; with tools offered as well (``auto``), either;
    ``auto`` with strict tools leaves text free and constrains calls once one
    opens. Families without a written grammar get no constraint on their calls.
    """
    from mlx_cairn import constrain

    vocab = constrain.vocabulary(loaded)
    family = loaded.parser_family
    forced = _forced_tools(request)
    fmt = request.output_format
    specials = loaded.tokenizer.special_tokens
    # A named choice is one call of that tool, whatever parallel_tool_calls says:
    # the turn ends after it (a second call of a tool the client asked for once
    # is a loop, and agent frameworks would run it twice).
    parallel = request.parallel_tool_calls and not isinstance(request.tool_choice, dict)
    param = "tools" if forced is not None else fmt.param if fmt is not None else "tools"
    try:
        tools_text = None
        if forced is not None or (fmt is not None and request.offers_tools):
            tools_text = constrain.tool_grammar(
                family,
                forced if forced is not None else list(request.tools),
                parallel=parallel,
                specials=specials,
            )
        if fmt is not None:
            constrain.check_schema(constrain.output_schema(fmt))
        if forced is not None:
            if tools_text is None:
                return None
            return vocab.compile_lark(tools_text)
        if fmt is None:  # auto with strict tools: constrained once a call opens
            lazy = constrain.strict_tools_grammar(
                family,
                list(request.tools),
                parallel=parallel,
                specials=specials,
                eos=loaded.eos_token_ids,
            )
            return vocab.compile_lark(lazy) if lazy is not None else None
        schema = constrain.styled(constrain.output_schema(fmt), strict=fmt.strict)
        if tools_text is None:
            return vocab.compile_json_schema(schema)
        return vocab.compile_lark(constrain.either(tools_text, schema))
    except ValueError as e:
        raise InvalidRequest(
            f"the schema cannot be used for constrained decoding: {e}", param=param
        ) from e
