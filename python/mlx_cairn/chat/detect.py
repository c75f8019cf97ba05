"""Which output-parser family and reasoning mode a model uses, read from its template and vocabulary.

Parser families (the Rust output parser implements each):

============  ====================================================
hermes        ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
qwen3_coder   ``<tool_call><function=NAME><parameter=P>..`` (XML-ish)
llama3        ``<|python_tag|>`` / bare JSON ``{"name": ..., "parameters": ...}``
mistral       ``[TOOL_CALLS][...]``
harmony       gpt-oss: ``<|channel|>commentary to=functions.NAME ..<|message|>{..}``
glm45         ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>``
deepseek_v3   ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>..`` (V3 and V3.1)
kimi_k2       ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0..``
gemma4        ``<|tool_call>call:NAME{k:<|"|>v<|"|>}<tool_call|>``
minimax_m2    ``<minimax:tool_call><invoke name="NAME"><parameter name="K">..``
pythonic      ``[f(a=1), g()]`` (Llama 3.2 / 4 pythonic templates)
============  ====================================================

Each family is known by markers only its chat template contains (the
template renders earlier tool calls in the model's own syntax, or tells the
model that syntax); :data:`_TEMPLATE_MARKERS` lists them, most specific first.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_cairn._core import FAMILIES

#: Every output-parser family (the Rust parser's list).
PARSER_FAMILIES: tuple[str, ...] = tuple(FAMILIES)

#: (family, markers any of which in the template source identifies it). Checked
#: in order before the older families: GLM-4.5 and MiniMax templates also
#: contain ``<tool_call>``-like text, so their own markers come first.
_TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>",)),
    ("gemma4", ("<|tool_call>", '<|"|>')),
    # MiniMax M2's role markers are unique to it.
    ("minimax_m2", ("<minimax:tool_call>", "]~!b[", "]~b]")),
    ("deepseek_v3", ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")),
    ("kimi_k2", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>")),
    ("glm45", ("<arg_key>",)),
    # Llama 3.2 / 4 pythonic templates spell the call format out, or use
    # Llama 4's python tags.
    ("pythonic", ("[func_name1(", "<|python_start|>")),
)

#: Template kwargs that switch reasoning on/off, in the order we look for them.
_REASONING_KWARGS = ("enable_thinking", "thinking", "reasoning")


@dataclass(frozen=True, slots=True)
class ReasoningInfo:
    """How a model reasons.

    Attributes:
        supported: the model emits reasoning blocks (``<think>...</think>``,
            or its family's own: gpt-oss's analysis channel, Gemma 4's
            ``<|channel>``).
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
    for family, markers in _TEMPLATE_MARKERS:
        if any(m in src for m in markers):
            return family
    if "<tool_call>" in src:
        return "qwen3_coder" if "<function=" in src else "hermes"
    if "[TOOL_CALLS]" in src or ("[TOOL_CALLS]" in vocab and "tool" in src):
        return "mistral"
    if "<|python_tag|>" in src or ("ipython" in src and "<|eot_id|>" in src):
        return "llama3"
    if "<tool_call>" in vocab and "tools" in src:
        return "hermes"
    return None


#: gpt-oss always reasons in its analysis channel (``reasoning_effort`` sets
#: how much, it cannot turn it off); the parser makes that channel reasoning.
HARMONY_REASONING = ReasoningInfo(
    supported=True,
    kwarg=None,
    default_on=True,
    open_tag="<|channel|>analysis<|message|>",
    close_tag="<|end|>",
)

#: Gemma 4 thinks when the template's ``enable_thinking`` is set (off by default).
GEMMA4_REASONING = ReasoningInfo(
    supported=True,
    kwarg="enable_thinking",
    default_on=False,
    open_tag="<|channel>",
    close_tag="<channel|>",
)


def detect_reasoning(template_source: str, vocab: set[str] | None = None) -> ReasoningInfo:
    """Read the reasoning mode from the template source and vocabulary."""
    # The tags in the vocabulary alone do not make a reasoning model (many
    # tokenizers carry them); the template must know about them.
    del vocab
    if "<|channel|>" in template_source:
        return HARMONY_REASONING
    if "<|channel>" in template_source or "<|think|>" in template_source:
        return GEMMA4_REASONING
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
