"""Which output-parser family and reasoning mode a model uses, read from its template and vocabulary.

Parser families (the Rust output parser implements each):

============  ====================================================
hermes        ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
qwen3_coder   ``<tool_call><function=NAME><parameter=P>..`` (XML-ish)
llama3        ``<|python_tag|>`` / bare JSON ``{"name": ..., "parameters": ...}``
mistral       ``[TOOL_CALLS][...]``
============  ====================================================
"""

from __future__ import annotations

from dataclasses import dataclass

PARSER_FAMILIES = ("hermes", "qwen3_coder", "llama3", "mistral")

#: Template kwargs that switch reasoning on/off, in the order we look for them.
_REASONING_KWARGS = ("enable_thinking", "thinking", "reasoning")


@dataclass(frozen=True, slots=True)
class ReasoningInfo:
    """How a model reasons.

    Attributes:
        supported: the model emits ``<think>...</think>`` blocks.
        kwarg: the template variable that turns reasoning on/off
            (e.g. ``"enable_thinking"``), or None when there is none.
        default_on: reasoning is on when the request does not say.
        open_tag / close_tag: the reasoning delimiters.

    Whether a prompt's generation starts *inside* ``<think>`` depends on the
    rendered prompt (templates may open the block themselves); see
    :func:`starts_in_reasoning`.
    """

    supported: bool = False
    kwarg: str | None = None
    default_on: bool = False
    open_tag: str = "<think>"
    close_tag: str = "</think>"


def detect_parser_family(template_source: str, vocab: set[str] | None = None) -> str | None:
    """Guess the tool-call output format from the chat template (and vocabulary)."""
    src = template_source
    vocab = vocab or set()
    if "<tool_call>" in src:
        return "qwen3_coder" if "<function=" in src else "hermes"
    if "[TOOL_CALLS]" in src or ("[TOOL_CALLS]" in vocab and "tool" in src):
        return "mistral"
    if "<|python_tag|>" in src or ("ipython" in src and "<|eot_id|>" in src):
        return "llama3"
    if "<tool_call>" in vocab and "tools" in src:
        return "hermes"
    return None


def detect_reasoning(template_source: str, vocab: set[str] | None = None) -> ReasoningInfo:
    """Read the reasoning mode from the template source and vocabulary."""
    # The tags in the vocabulary alone do not make a reasoning model (many
    # tokenizers carry them); the template must know about them.
    del vocab
    if "<think>" not in template_source and "</think>" not in template_source:
        return ReasoningInfo()
    kwarg = next((k for k in _REASONING_KWARGS if k in template_source), None)
    # Qwen3-style templates default to thinking unless told `enable_thinking=false`.
    default_on = True
    if kwarg is not None and f"{kwarg} is defined and {kwarg} is true" in template_source:
        default_on = False
    return ReasoningInfo(supported=True, kwarg=kwarg, default_on=default_on)


def starts_in_reasoning(prompt_text: str, info: ReasoningInfo) -> bool:
    """True when the rendered prompt leaves a reasoning block open for the model."""
    if not info.supported:
        return False
    i = prompt_text.rfind(info.open_tag)
    return i >= 0 and prompt_text.rfind(info.close_tag) < i
