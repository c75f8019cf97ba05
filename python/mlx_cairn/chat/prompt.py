"""ChatRequest -> rendered prompt text -> prompt token ids.

Example::

    prompt = build_prompt(req, template, tokenizer, reasoning)
    prompt.ids            # what the engine prefills
    prompt.in_reasoning   # generation starts inside <think>
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_cairn.chat.data import DataMarks, encode_rendered
from mlx_cairn.chat.detect import ReasoningInfo, starts_in_reasoning
from mlx_cairn.chat.template import ChatTemplate
from mlx_cairn.chat.tokenizer import Tokenizer
from mlx_cairn.types import ChatRequest


@dataclass(frozen=True, slots=True)
class Prompt:
    """A rendered prompt."""

    text: str
    ids: list[int]
    #: The template left a ``<think>`` block open: output starts as reasoning.
    in_reasoning: bool


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
) -> Prompt:
    """Render ``req`` through the chat template and tokenize it (HF semantics).

    Tools are passed unless ``tool_choice == "none"``. BOS is prepended only
    when the tokenizer asks for it and the template did not write it. Only
    the template's own markup becomes special tokens: special-token text in
    the request's strings is tokenized as plain text (chat/data.py).
    """
    tools = req.tools if req.offers_tools else None
    marks = DataMarks(tokenizer.special_tokens)
    marked = template.render_marked(
        req.messages,
        tools,
        marks,
        add_generation_prompt=True,
        kwargs=template_kwargs(req, reasoning),
    )
    ids, markup = encode_rendered(tokenizer, marked, marks)
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    # Look for an open reasoning block only after the template's last special
    # token (reasoning tags aside): a "<think>" in the request's text must
    # not make the answer start as reasoning.
    tags = (reasoning.open_tag, reasoning.close_tag)
    tail = max((end for _, end, tid in markup if tokenizer.id_to_token(tid) not in tags), default=0)
    return Prompt(
        text=marks.restore(marked),
        ids=ids,
        in_reasoning=starts_in_reasoning(marked[tail:], reasoning),
    )
