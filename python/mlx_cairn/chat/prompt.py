"""ChatRequest -> rendered prompt text -> prompt token ids.

Example::

    prompt = build_prompt(req, template, tokenizer, reasoning)
    prompt.ids            # what the engine prefills
    prompt.in_reasoning   # generation starts inside <think>
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from mlx_cairn.chat.data import DataMarks, encode_rendered
from mlx_cairn.chat.detect import ReasoningInfo, starts_in_reasoning
from mlx_cairn.chat.history import render_as_generated
from mlx_cairn.chat.template import ChatTemplate
from mlx_cairn.chat.tokenizer import Tokenizer
from mlx_cairn.types import ChatRequest, Message, RawPrompt


@dataclass(frozen=True, slots=True)
class Prompt:
    """A rendered prompt."""

    text: str
    ids: list[int]
    #: The template left a ``<think>`` block open: output starts as reasoning.
    in_reasoning: bool
    #: Index of the token where the last user message's text starts, when
    #: asked for and found (a state snapshot point of hybrid models).
    last_user_at: int | None = None
    #: A vision model's pictures in the prompt (``mlx_cairn.models.vision.Media``).
    media: Any = None


def template_kwargs(req: ChatRequest, reasoning: ReasoningInfo) -> dict[str, Any]:
    """Extra template variables for ``req`` (the reasoning switch, then the request's own)."""
    kwargs: dict[str, Any] = {}
    if reasoning.kwarg is not None and req.reasoning is not None:
        kwargs[reasoning.kwarg] = req.reasoning
    kwargs.update(req.template_kwargs)
    return kwargs


def build_prompt(
    req: ChatRequest,
    template: ChatTemplate,
    tokenizer: Tokenizer,
    reasoning: ReasoningInfo,
    *,
    locate_last_user: bool = False,
) -> Prompt:
    """Render ``req`` through the chat template and tokenize it (HF semantics).

    Tools are passed unless ``tool_choice == "none"``. BOS is prepended only
    when the tokenizer asks for it and the template did not write it. Only
    the template's own markup becomes special tokens: special-token text in
    the request's strings is tokenized as plain text (chat/data.py).

    ``locate_last_user``: also find the token where the last user message's
    text starts (``Prompt.last_user_at``), by rendering once more with a
    sentinel character before it; it counts only if the template renders the
    same text around the sentinel (no template trims or rewrites it).

    With ``req.history_as_generated`` earlier turns are rendered as they were
    generated where the template would rewrite them (chat/history.py).
    """
    tools = req.tools if req.offers_tools else None
    marks = DataMarks(tokenizer.special_tokens)
    kwargs = template_kwargs(req, reasoning)

    def render_turns(messages: list[Message], generation_prompt: bool) -> str:
        return template.render_marked(
            messages, tools, marks, add_generation_prompt=generation_prompt, kwargs=kwargs
        )

    def render(messages: list[Message]) -> str:
        text = render_turns(messages, True)
        if req.history_as_generated:
            text = render_as_generated(messages, render_turns, text, marks.restore)
        return text

    marked = render(req.messages)
    at = _last_user_offset(req.messages, marked, render) if locate_last_user else None
    ids, markup, token_at = encode_rendered(tokenizer, marked, marks, at)
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
        token_at = None if token_at is None else token_at + 1
    # Look for an open reasoning block only after the template's last special
    # token (reasoning tags aside): a "<think>" in the request's text must
    # not make the answer start as reasoning.
    tags = (reasoning.open_tag, reasoning.close_tag)
    tail = max((end for _, end, tid in markup if tokenizer.id_to_token(tid) not in tags), default=0)
    return Prompt(
        text=marks.restore(marked),
        ids=ids,
        in_reasoning=starts_in_reasoning(marked[tail:], reasoning),
        last_user_at=token_at,
    )


def build_raw_prompt(raw: RawPrompt, tokenizer: Tokenizer) -> Prompt:
    """The prompt of a request without a chat template (legacy completions).

    Client token ids are taken as they are. Text is tokenized as Hugging
    Face's ``tokenizer(text)`` does, the way llama.cpp, vLLM and mlx-lm read a
    completions prompt: BOS first where the tokenizer adds one, special-token
    strings as their control tokens (the client writes the whole prompt, its
    markup included). With a suffix it is a fill-in-the-middle prompt, where
    prefix and suffix are code and so plain text (:func:`fim_prompt`).

    Example::

        build_raw_prompt(RawPrompt(text="Once upon a time"), tok).ids
    """
    from mlx_cairn.chat.fim import fim_family, fim_prompt

    if raw.ids is not None:
        return Prompt(text="", ids=list(raw.ids), in_reasoning=False)
    if raw.suffix or (raw.suffix is not None and fim_family(tokenizer) is not None):
        ids = fim_prompt(tokenizer, raw.text, raw.suffix, raw.extra)
        return Prompt(
            text=tokenizer.decode(ids, skip_special_tokens=False), ids=ids, in_reasoning=False
        )
    ids = tokenizer.encode(raw.text)
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return Prompt(text=raw.text, ids=ids, in_reasoning=False)


#: A private-use character (plane 15: DataMarks uses plane 16), removed again
#: before tokenizing.
_SENTINEL = "\U000ffffd"


def _last_user_offset(
    messages: list[Message], marked: str, render: Callable[[list[Message]], str]
) -> int | None:
    """Character offset in ``marked`` where the last user message's text starts, or None."""
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "user"), None)
    if last is None or _SENTINEL in marked:
        return None
    probe = list(messages)
    probe[last] = replace(messages[last], content=_SENTINEL + messages[last].content)
    with_sentinel = render(probe)
    at = with_sentinel.find(_SENTINEL)
    if at < 0 or with_sentinel.count(_SENTINEL) != 1:
        return None
    if with_sentinel[:at] + with_sentinel[at + 1 :] != marked:
        return None
    return at
