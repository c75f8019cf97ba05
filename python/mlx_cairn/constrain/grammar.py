"""Grammar-constrained decoding: structured outputs and forced tool calls.

A thin layer over the Rust ``cairn-constrain`` crate (llguidance): the token
trie is built once per tokenizer (:func:`vocabulary`), a request's grammar is
compiled once in ``Engine.prepare`` (a schema that does not compile is a 400
before any work), and each generating row gets a :class:`GrammarMask`, the
engine's row-mask seam (``mlx_cairn.engine.logits.RowMask``): it reads every
sampled token on the host, so its row skips the one-step look-ahead.

Example::

    vocab = vocabulary(loaded)
    compiled = vocab.compile_json_schema('{"type": "object"}')
    seq.row_masks.append(GrammarMask(vocab.matcher(compiled)))

Tool calls are constrained in the model family's own syntax around each
tool's input schema, so the output parsers read the result unchanged
(:func:`tool_grammar`).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import mlx.core as mx
import numpy as np
import orjson

from mlx_cairn._core import CompiledGrammar, GrammarMatcher, GrammarVocabulary
from mlx_cairn.constrain import tool_grammars
from mlx_cairn.models.loaded import vocab_size
from mlx_cairn.types import OutputFormat, Tool

#: How JSON is written under a grammar: between two tokens of JSON, nothing, one
#: space, or one line break and an indent of up to 16 spaces. A model's own JSON
#: is often laid out on lines (SmolLM2's first choice after ``{`` is a line break:
#: forcing ``{"`` instead puts it off its path, and more answers loop); the bound
#: keeps a small model from padding forever, as unbounded whitespace would let it.
JSON_STYLE = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
    "whitespace_pattern": r"[ ]|\n[ ]{0,16}",
}

#: Families whose tool-call syntax a grammar is written for (every parser family).
GRAMMAR_FAMILIES = tuple(tool_grammars.SYNTAXES)

_vocabularies: weakref.WeakKeyDictionary[Any, GrammarVocabulary] = weakref.WeakKeyDictionary()
_vocab_lock = threading.Lock()


def vocabulary(loaded: Any) -> GrammarVocabulary:
    """The token trie of ``loaded``'s tokenizer (built on first use, then shared)."""
    tok = loaded.tokenizer
    with _vocab_lock:
        v = _vocabularies.get(tok)
        if v is None:
            v = GrammarVocabulary(
                tok.hf.to_str(), sorted(int(t) for t in loaded.eos_token_ids), vocab_size(loaded)
            )
            _vocabularies[tok] = v
    return v


#: Numbers stay within what every JSON reader keeps exactly (I-JSON, RFC 7493):
#: an unbounded number grammar lets a small model write digits until max_tokens,
#: or an exponent (``2E2345``) that overflows a double, which JSON readers then
#: refuse (the Rust tool-call parsers drop such a call). Bounded, a number is
#: written without an exponent.
SAFE_INTEGER = 2**53 - 1
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def interoperable(schema: Any) -> Any:
    """``schema`` with each number that has no bound limited to +-SAFE_INTEGER."""
    if isinstance(schema, list):
        return [interoperable(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: interoperable(v) for k, v in schema.items()}
    kind = schema.get("type")
    numeric = ("integer", "number")
    is_num = kind in numeric or (isinstance(kind, list) and any(k in kind for k in numeric))
    if is_num and not any(b in schema for b in _BOUNDS):
        out["minimum"], out["maximum"] = -SAFE_INTEGER, SAFE_INTEGER
    return out


def styled(schema: dict[str, Any], *, strict: bool = True) -> str:
    """``schema`` as JSON text with the output style set (``x-guidance``).

    Not ``strict``: keywords the grammar engine cannot enforce are ignored
    (left to the model) instead of refusing the schema.
    """
    style = {**JSON_STYLE, "lenient": not strict}
    return orjson.dumps({**interoperable(schema), "x-guidance": style}).decode()


def check_schema(schema: Any) -> None:
    """A schema must be a JSON object (llguidance names anything it cannot compile)."""
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, not {type(schema).__name__}")


def either(tools_grammar: str, schema_json: str) -> str:
    """A grammar for a tool call (``tools_grammar``) or an answer matching ``schema_json``."""
    lines = tools_grammar.splitlines()
    renamed = ["calls:" + ln[len("start:") :] if ln.startswith("start:") else ln for ln in lines]
    return "\n".join(["start: calls | answer", *renamed, f"answer: %json {schema_json}", ""])


def output_schema(fmt: OutputFormat) -> dict[str, Any]:
    """The schema an answer must match (``json_object``: any JSON object)."""
    return fmt.schema if fmt.schema is not None else {"type": "object"}


#: Keywords whose value is one subschema, a list of them, or a map of them: where
#: :func:`closed` looks for nested objects.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_LIST = ("prefixItems", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` but says nothing of other
    keys closed to them (``additionalProperties: false``).

    Tool arguments are written under the strict reading: a client that omits
    ``additionalProperties`` (langchain's ``@tool`` schemas, most MCP servers)
    means the keys it lists, and an open object lets a small model write keys
    of its own until ``max_tokens`` (``"properties": {...}`` inside the
    arguments). This is xgrammar's strict default, what vLLM and SGLang apply.
    An object that lists no properties (``{"type": "object"}``) stays open,
    and so do the branches of an ``allOf``, whose keys are spread over its parts.
    """
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _ONE:
        if k in out:
            out[k] = closed(out[k])
    for k in _LIST:
        if isinstance(out.get(k), list):
            out[k] = [closed(v) for v in out[k]]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {n: closed(v) for n, v in out[k].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed(out["additionalProperties"])
    if isinstance(out.get("properties"), dict) and not any(
        k in out for k in (*_OPEN_KEYS, "allOf")
    ):
        out["additionalProperties"] = False
    return out


def _closed_tool(tool: Tool) -> Tool:
    return dataclasses.replace(tool, parameters=closed(tool.parameters))


def tool_grammar(
    family: str | None,
    tools: list[Tool],
    *,
    parallel: bool,
    specials: Mapping[str, int] | None = None,
) -> str | None:
    """A Lark grammar for one (or, with ``parallel``, one or more) call of ``tools`` in
    ``family``'s syntax (:data:`mlx_cairn.constrain.tool_grammars.SYNTAXES`); None when no
    grammar is written for the family. ValueError when a tool cannot be written in it.

    ``specials``: the tokenizer's special tokens (text -> id); the family's markers
    among them (Mistral's ``[TOOL_CALLS]``, harmony's ``<|channel|>``) are matched as
    those tokens. Arguments follow :func:`closed` schemas (no keys beyond the listed
    ones unless the schema allows them).
    """
    return tool_grammars.forced(
        family,
        [_closed_tool(t) for t in tools],
        parallel=parallel,
        specials=specials or {},
        styled=styled,
    )


#: Families whose calls open with a tag, so a grammar can wait for it (strict tools
#: under ``auto``): the text before the tag is free.
OPEN_TAGS = {f: s.open for f, s in tool_grammars.SYNTAXES.items() if s.open is not None}


def strict_tools_grammar(
    family: str | None,
    tools: list[Tool],
    *,
    parallel: bool,
    specials: Mapping[str, int] | None = None,
    eos: Iterable[int] = (),
) -> str | None:
    """``auto`` with strict tools: free text, or text then calls whose arguments match.

    Text that never opens a call ends freely; once the family's opening tag
    (:data:`OPEN_TAGS`) is written, the call (and, with ``parallel``, any that
    follow) is constrained. Tools not marked strict take any object as arguments.
    """
    if family not in OPEN_TAGS or not any(t.strict for t in tools):
        return None
    shaped = [
        _closed_tool(t) if t.strict else Tool(t.name, t.description, {"type": "object"})
        for t in tools
    ]
    return tool_grammars.lazy(
        family, shaped, parallel=parallel, specials=specials or {}, eos=eos, styled=styled
    )


class GrammarMask:
    """One row's grammar as a row mask (see :mod:`mlx_cairn.engine.logits`).

    ``start_after``: token ids that must appear in the output before the
    grammar applies (the close of reasoning when generation starts inside
    it); until then the row is unconstrained.
    """

    needs_host_token = True

    def __init__(self, matcher: GrammarMatcher, start_after: list[int] | None = None) -> None:
        self.matcher = matcher
        self.start_after = list(start_after or [])
        self._begin: int | None = None if self.start_after else 0
        self._consumed = 0  # output tokens fed to the matcher, counted from _begin

    def mask(self, seq: Any, vocab: int) -> mx.array | None:
        out = seq.tokens[seq.num_prompt :]
        if self._begin is None:
            self._begin = _find_end(out, self.start_after)
            if self._begin is None:
                return None
        for t in out[self._begin + self._consumed :]:
            self.matcher.consume(t)
            self._consumed += 1
        return mx.array(np.frombuffer(self.matcher.mask(), dtype=np.float32))


def _find_end(tokens: list[int], pattern: list[int]) -> int | None:
    """Index just past the first occurrence of ``pattern`` in ``tokens``."""
    n = len(pattern)
    for i in range(len(tokens) - n + 1):
        if tokens[i : i + n] == pattern:
            return i + n
    return None


__all__ = [
    "GRAMMAR_FAMILIES",
    "OPEN_TAGS",
    "CompiledGrammar",
    "GrammarMask",
    "GrammarVocabulary",
    "check_schema",
    "closed",
    "either",
    "output_schema",
    "strict_tools_grammar",
    "styled",
    "tool_grammar",
    "vocabulary",
]
