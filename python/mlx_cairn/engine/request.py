"""A request after templating, tokenizing and validation: what the engine serves.

``Engine.prepare`` (engine/prepare.py) builds it; a
:class:`~mlx_cairn.engine.stream.RequestStream` carries it to the client's side and
a :class:`~mlx_cairn.engine.sequence.Sequence` to the engine thread's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_cairn.types import ChatRequest, SamplingParams


@dataclass(slots=True)
class PreparedRequest:
    """A request after templating, tokenizing and validation (``Engine.prepare``)."""

    request: ChatRequest
    prompt_ids: list[int]
    #: Output parser family for this request (None: plain text, no tool parsing).
    parser_family: str | None
    #: Whether the output parser splits ``<think>`` reasoning from text.
    reasoning: bool
    #: Whether generation starts inside an open reasoning block.
    in_reasoning: bool
    #: Prefix-cache salt (model identity + request cache salt).
    salt: str
    max_tokens: int
    #: Sampling settings with the seed resolved (a random one when the request has none).
    sampling: SamplingParams
    #: Reasoning tokens allowed before the engine closes the block (None: no limit).
    reasoning_budget: int | None = None
    #: Token ids of the model's reasoning open / close tags (for the budget).
    reasoning_tags: tuple[list[int], list[int]] = ([], [])
    #: The compiled grammar output must follow (``mlx_cairn.constrain``), or None.
    grammar: Any = None
    #: Output token ids after which the grammar starts (the close of reasoning).
    grammar_after: list[int] = field(default_factory=list)
    #: Prompt token where the last user message starts (hybrid models: a state
    #: snapshot point, so another question after the same history hits).
    last_user_at: int | None = None
    #: Token ids that end generation as EOS does, for this request only (a
    #: fill-in-the-middle prompt's end-of-middle tokens).
    stop_token_ids: frozenset[int] = frozenset()
    #: A vision model's pictures in the prompt (``mlx_cairn.models.vision.Media``), or None.
    media: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)
