"""The tool-call families: one entry per output format the Rust parser reads.

Each :class:`ToolFamily` holds what the Python side knows of one format: its
name (as ``rust/text`` ``Family::NAMES`` spells it), the signs in a chat
template (and vocabulary) that give it away, its own reasoning delimiters if
it has any, how its output is decoded and parsed, and the layout of its calls
for the grammars that force them. Everything else reads this table:

=======================================  ==============================================
reader                                   what it takes
=======================================  ==============================================
``mlx_cairn.chat.detect``                :data:`SIGNS`, :class:`Reasoning` (detection)
``mlx_cairn.text``                       special-token, structural and schema families
``mlx_cairn.constrain.tool_grammars``    :class:`Calls` (one ``Syntax`` per family)
``mlx_cairn.models.loaded``              :data:`VOCAB_TOKENS`, :data:`TEMPLATE_FALLBACK`
=======================================  ==============================================

Adding a family: one entry in :data:`FAMILIES`, its scanner in ``rust/text``
(``tags.rs`` ``Family``, ``formats/``), and a grammar writer in
:mod:`mlx_cairn.constrain.tool_grammars` when no existing one writes its calls.
``tests/test_tool_families.py`` checks the table against the Rust parser.

Example::

    >>> FAMILY["glm45"].schema_typed, FAMILY["harmony"].structural
    (True, True)
    >>> FAMILY["mistral"].calls.open
    '[TOOL_CALLS]'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: How much a :class:`Sign` says. ``"own"``: text only this family's templates
#: hold (they write its calls, or tell the model its syntax): tried first, and a
#: template that has it but renders calls without a tools list gets no family
#: (ChatTemplate spells its tools the Hermes way). ``"shared"``: tags other
#: formats share (``<tool_call>``), tried after every ``"own"`` sign.
#: ``"hint"``: a guess from the vocabulary, tried last.
Strength = Literal["own", "shared", "hint"]
_STRENGTH_ORDER: dict[Strength, int] = {"own": 0, "shared": 1, "hint": 2}


@dataclass(frozen=True, slots=True)
class Sign:
    """Evidence that a model writes a family's calls.

    It matches when every string of ``template`` is in the chat template's
    source and ``token`` (if any) is in the vocabulary.
    """

    template: tuple[str, ...]
    strength: Strength = "own"
    token: str | None = None

    def matches(self, source: str, vocab: set[str]) -> bool:
        """Whether ``source`` (and ``vocab``) show this sign."""
        return all(m in source for m in self.template) and (
            self.token is None or self.token in vocab
        )


def _own(*markers: str) -> tuple[Sign, ...]:
    """Any of ``markers`` (each only in this family's templates)."""
    return tuple(Sign((m,)) for m in markers)


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A family's own reasoning delimiters (the rest use ``<think>``..``</think>``).

    ``markers``: any of them in the template means the model reasons this
    way; ``kwarg``: the template variable that switches it (None: it cannot
    be switched off); ``default_on``: on when the request does not say.
    """

    markers: tuple[str, ...]
    open_tag: str
    close_tag: str
    kwarg: str | None
    default_on: bool


@dataclass(frozen=True, slots=True)
class Calls:
    """How a family lays out tool calls, for the grammars that force them.

    A forced grammar is ``lead? open head call (sep call)* tail`` (one call
    when ``sep`` is None or parallel calls are off); ``open`` is the tag a
    strict-tools grammar under ``auto`` waits for (None: the calls open with
    no tag); ``markers``: the family's tags, matched as special tokens where
    the tokenizer has them. ``writer`` names the function that writes one call
    (and any ``lead``): a key of
    :data:`mlx_cairn.constrain.tool_grammars.WRITERS`.
    """

    writer: str
    open: str | None
    head: str
    sep: str | None
    tail: str
    markers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolFamily:
    """One tool-call output format.

    Attributes:
        name: the Rust parser's name for it (``family=`` of ``mlx_cairn.text``).
        example: one call of ``f`` with ``{"a": 1}``, as the model writes it
            (the tests parse it).
        signs: how a chat template (and vocabulary) shows the format.
        calls: the layout of its calls, for grammars.
        reasoning: its own reasoning delimiters, or None for ``<think>``.
        special_tokens: its tags are special tokens of its models' tokenizers,
            so decoding that skips special tokens would lose its structure.
        structural: replies are structured even without tools (channels), so
            they are parsed whether or not the request offers tools.
        schema_typed: argument values are raw text that the parser types by
            the tools' schemas (it needs ``tool_schemas=``); the other raw-text
            family, ``qwen3_coder``, reads any value that parses as JSON as JSON.
    """

    name: str
    example: str
    signs: tuple[Sign, ...]
    calls: Calls
    reasoning: Reasoning | None = None
    special_tokens: bool = False
    structural: bool = False
    schema_typed: bool = False


_TAGGED = ("<tool_call>", "</tool_call>")
_DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
_DS_CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
_KIMI = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")

#: Every family, in the order detection tries their signs (within a strength):
#: GLM-4.5 and MiniMax templates also hold ``<tool_call>``-like text, so the
#: families with their own markers come first, and Qwen3-Coder before Hermes.
FAMILIES: tuple[ToolFamily, ...] = (
    ToolFamily(
        "harmony",
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>',
        _own("<|channel|>"),
        Calls(
            "harmony", None, "", None, "",
            ("<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|start|>"),
        ),
        # gpt-oss always reasons in its analysis channel (reasoning_effort sets
        # how much, it cannot turn it off); the parser makes that channel reasoning.
        Reasoning(("<|channel|>",), "<|channel|>analysis<|message|>", "<|end|>", None, True),
        special_tokens=True,
        structural=True,
    ),
    ToolFamily(
        "gemma4",
        "<|tool_call>call:f{a:1}<tool_call|>",
        _own("<|tool_call>", '<|"|>'),
        Calls(
            "gemma4", "<|tool_call>", "", "<tool_call|><|tool_call>", "<tool_call|>",
            ("<|tool_call>", "<tool_call|>", '<|"|>'),
        ),
        # Gemma 4 thinks when the template's enable_thinking is set (off by default).
        Reasoning(("<|channel>", "<|think|>"), "<|channel>", "<channel|>", "enable_thinking", False),
        special_tokens=True,
        structural=True,
    ),
    ToolFamily(
        "minimax_m2",
        '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">1</parameter>\n</invoke>\n'
        "</minimax:tool_call>",
        # MiniMax M2's role markers are unique to it.
        _own("<minimax:tool_call>", "]~!b[", "]~b]"),
        Calls(
            "minimax_m2", "<minimax:tool_call>", "\n", "\n", "\n</minimax:tool_call>",
            ("<minimax:tool_call>", "</minimax:tool_call>"),
        ),
        special_tokens=True,
        schema_typed=True,
    ),
    ToolFamily(
        "deepseek_v3",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>",
        _own(_DS[0], _DS_CALL[0]),
        Calls("deepseek_v3", _DS[0], "", "\n", _DS[1], (*_DS, *_DS_CALL)),
        special_tokens=True,
    ),
    ToolFamily(
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        '{"a": 1}<|tool_call_end|><|tool_calls_section_end|>',
        _own(_KIMI[0], "<|tool_call_begin|>"),
        Calls(
            "kimi_k2", _KIMI[0], "", "", _KIMI[1],
            (*_KIMI, "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
        ),
        special_tokens=True,
    ),
    ToolFamily(
        "glm45",
        "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
        _own("<arg_key>"),
        Calls(
            "glm45", "<tool_call>", "", "\n</tool_call>\n<tool_call>", "\n</tool_call>",
            (*_TAGGED, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        ),
        special_tokens=True,
        schema_typed=True,
    ),
    ToolFamily(
        "pythonic",
        "[f(a=1)]",
        # Llama 3.2 / 4 pythonic templates spell the call format out, or use
        # Llama 4's python tags.
        _own("[func_name1(", "<|python_start|>"),
        Calls("pythonic", None, "[", ", ", "]"),
        special_tokens=True,
    ),
    ToolFamily(
        "qwen3_coder",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        (Sign(("<tool_call>", "<function="), "shared"),),
        Calls(
            "qwen3_coder", "<tool_call>", "\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>",
            _TAGGED,
        ),
    ),
    ToolFamily(
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
        (Sign(("<tool_call>",), "shared"), Sign(("tools",), "hint", "<tool_call>")),
        Calls(
            "json_arguments", "<tool_call>", "\n", "\n</tool_call>\n<tool_call>\n",
            "\n</tool_call>", _TAGGED,
        ),
    ),
    ToolFamily(
        "mistral",
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]',
        # A template that speaks of tools and a vocabulary with [TOOL_CALLS]
        # (tried before Llama 3's tags).
        (Sign(("[TOOL_CALLS]",), "shared"), Sign(("tool",), "shared", "[TOOL_CALLS]")),
        Calls("json_arguments", "[TOOL_CALLS]", "[", ", ", "]", ("[TOOL_CALLS]",)),
        # Mistral's reasoning models (Magistral, Ministral 3 Reasoning) think in
        # [THINK]..[/THINK], always (a system prompt asks for it).
        Reasoning(("[THINK]",), "[THINK]", "[/THINK]", None, True),
        special_tokens=True,
    ),
    ToolFamily(
        "llama3",
        '<|python_tag|>{"name": "f", "parameters": {"a": 1}}',
        (Sign(("<|python_tag|>",), "shared"), Sign(("ipython", "<|eot_id|>"), "shared")),
        Calls("json_parameters", None, "", "; ", ""),
        special_tokens=True,
    ),
)  # fmt: skip

#: name -> family.
FAMILY: dict[str, ToolFamily] = {f.name: f for f in FAMILIES}

#: Every family's name, in table order.
NAMES: tuple[str, ...] = tuple(FAMILY)

#: (family, sign) in the order detection tries them: by strength, then table order.
SIGNS: tuple[tuple[str, Sign], ...] = tuple(
    sorted(
        ((f.name, s) for f in FAMILIES for s in f.signs),
        key=lambda fs: _STRENGTH_ORDER[fs[1].strength],
    )
)

#: The vocabulary entries detection looks for (the ``token`` of a sign).
VOCAB_TOKENS: tuple[str, ...] = tuple(dict.fromkeys(s.token for _, s in SIGNS if s.token))

#: The family ChatTemplate writes tools and calls in for a template that does
#: not render tools itself.
TEMPLATE_FALLBACK = "hermes"


def names_where(flag: str) -> frozenset[str]:
    """The families whose boolean attribute ``flag`` is set.

    >>> sorted(names_where("structural"))
    ['gemma4', 'harmony']
    """
    return frozenset(f.name for f in FAMILIES if getattr(f, flag))


__all__ = [
    "FAMILIES",
    "FAMILY",
    "NAMES",
    "SIGNS",
    "TEMPLATE_FALLBACK",
    "VOCAB_TOKENS",
    "Calls",
    "Reasoning",
    "Sign",
    "Strength",
    "ToolFamily",
    "names_where",
]
