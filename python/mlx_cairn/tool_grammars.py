"""Tool-call grammars in each parser family's own syntax (llguidance Lark).

A forced call (``tool_choice`` required / a named tool) and a strict tool
under ``auto`` are constrained in exactly the syntax the family's Rust parser
reads (``rust/text``: ``parser.rs``, ``toolcall.rs``, ``formats/``), as the
chat templates write it, so the parser turns the output into the call the
grammar allowed. :data:`SYNTAXES` is the one table: for each family, the tag
that opens its calls, what comes around and between calls, and how one call
and its argument values are written::

    family        one call (inside the section)                            values
    hermes        <tool_call>\\n{"name": N, "arguments": {..}}\\n</tool_call>   JSON
    llama3        {"name": N, "parameters": {..}}  (several: "; ")           JSON
    mistral       [TOOL_CALLS][{"name": N, "arguments": {..}}, ..]          JSON
    qwen3_coder   <tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>\\n..</function>\\n</tool_call>
                                                                          raw text or JSON
    glm45         <tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>..\\n</tool_call>
                                                                          raw text or JSON
    minimax_m2    <minimax:tool_call>\\n<invoke name="N">\\n<parameter name="K">V</parameter>\\n..</invoke>\\n</minimax:tool_call>
                                                                          raw text or JSON
    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>{..}<｜tool▁call▁end｜>..<｜tool▁calls▁end｜>
                  (or V3's function<｜tool▁sep｜>N\\n```json\\n{..}\\n```)       JSON
    kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.N:0<|tool_call_argument_begin|>{..}<|tool_call_end|>..
                                                                          JSON
    harmony       <|channel|>commentary to=functions.N <|constrain|>json<|message|>{..}  (one call; <|call|> ends the turn)
                                                                          JSON
    gemma4        <|tool_call>call:N{k:<|"|>v<|"|>,n:1}<tool_call|>           Gemma values
    pythonic      [N(k="v", n=1), ..]                                      Python literals

Raw-text values (``qwen3_coder``, ``glm45``, ``minimax_m2``) are typed by the
parser: GLM-4.5 and MiniMax keep a value as a string when the tool's schema
says its parameter is a string (:func:`rust_is_string`, the Rust rule) and read
anything else as JSON; Qwen3-Coder reads a value as JSON whenever it parses as
JSON. So a string parameter is raw text that cannot be mistaken for JSON
(Qwen3-Coder: it does not start like JSON; or a JSON string, which it reads
back exactly), and every other parameter is JSON under its schema (``%json``).

Literal text that is a special token of the tokenizer (``[TOOL_CALLS]``,
``<|channel|>``, ``<|"|>``) is matched as that token (``<[id]>``); the parser
sees it because these families decode with special tokens kept.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from mlx_cairn.types import Tool

Schema = Any  # a JSON Schema: a dict, or True / False


# ---- grammar text --------------------------------------------------------


class Rules:
    """A grammar under construction: named rules, literals, special tokens.

    ``specials``: the tokenizer's special tokens (text -> id); ``markers``:
    the family texts that are matched as a token when the tokenizer has them.
    """

    def __init__(self, specials: Mapping[str, int], markers: Iterable[str], styled: Callable):
        self.styled = styled
        self.lines: list[str] = []
        self._memo: dict[Any, str] = {}
        self._n = 0
        self.tokens = {m: specials[m] for m in markers if m in specials}
        self._split = (
            re.compile("|".join(re.escape(m) for m in sorted(self.tokens, key=len, reverse=True)))
            if self.tokens
            else None
        )
        self.defs: dict[str, Any] = {}  # the tool schema's $defs, for embedded %json

    def rule(self, body: str, key: Any = None, *, terminal: bool = False) -> str:
        """A new rule (``terminal``: a lexeme) for ``body``; the same ``key`` gives the same rule."""
        if key is not None and key in self._memo:
            return self._memo[key]
        self._n += 1
        name = f"{'T' if terminal else 'r'}{self._n}"
        if key is not None:
            self._memo[key] = name
        self.lines.append(f"{name}: {body}")
        return name

    def lit(self, text: str) -> str:
        """``text`` as grammar: quoted literals, with special-token markers as ``<[id]>``."""
        if not text:
            return '""'
        if self._split is None:
            return _q(text)
        out, pos = [], 0
        for m in self._split.finditer(text):
            if m.start() > pos:
                out.append(_q(text[pos : m.start()]))
            out.append(f"<[{self.tokens[m.group()]}]>")
            pos = m.end()
        if pos < len(text):
            out.append(_q(text[pos:]))
        return " ".join(out)

    def is_token(self, text: str) -> bool:
        return text in self.tokens

    def json(self, schema: Schema) -> str:
        """A JSON value matching ``schema`` (llguidance's JSON Schema compiler)."""
        if schema is True:
            schema = {}
        if isinstance(schema, dict) and self.defs and "$defs" not in schema:
            schema = {**schema, "$defs": self.defs}
        return self.rule(f"%json {self.styled(schema)}", ("json", orjson.dumps(schema)))

    def text(self, start: str = "start") -> str:
        return "\n".join([*self.lines, ""]) if start else "\n".join(self.lines)


def _q(text: str) -> str:
    return orjson.dumps(text).decode()


_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def rx(text: str) -> str:
    """``text`` as a literal inside a grammar regex (``/../``)."""
    out = []
    for c in text:
        if c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif c == "\r":
            out.append("\\r")
        else:
            out.append("\\" + c if c in _REGEX_META else c)
    return "".join(out)


def without(*texts: str) -> str:
    """A regex term: text that contains none of ``texts``."""
    alts = "|".join(rx(t) for t in texts)
    return f"~/(?s:.*)({alts})(?s:.*)/"


#: Text the parsers drop or treat as structure wherever it appears (their
#: end-of-turn and role markers): raw values never contain it.
MARKER_TEXT = ("<|", "<end_of_turn>", "<start_of_turn>", "<｜")


def pattern_rx(pattern: str) -> str:
    """A JSON Schema ``pattern`` (a search, anchored only by ``^`` / ``$``) as a whole-text regex."""
    p = pattern.replace("/", "\\/")
    start = p.startswith("^")
    end = p.endswith("$") and not p.endswith("\\$")
    p = p[1 if start else 0 : len(p) - 1 if end else len(p)]
    return f"{'' if start else '(?s:.*)'}({p}){'' if end else '(?s:.*)'}"


# ---- schemas ---------------------------------------------------------------

#: Assertions no written syntax here enforces: a schema using one is refused
#: (JSON families hand the schema to llguidance, which says what it refuses).
UNSUPPORTED = frozenset(
    {
        "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
        "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas",
        "dependencies", "minProperties", "maxProperties", "unevaluatedProperties",
        "unevaluatedItems", "additionalItems",
    }
)  # fmt: skip
_COMBINE = ("anyOf", "oneOf")


def resolve(root: Schema, schema: Schema) -> Schema:
    """``schema`` with a local ``$ref`` (``#/$defs/..``, ``#/definitions/..``) followed."""
    seen = 0
    while isinstance(schema, dict) and "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"$ref {ref!r} is not a local reference")
        target: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"$ref {ref!r} points nowhere")
            target = target[part]
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**target, **rest} if isinstance(target, dict) and rest else target
        seen += 1
        if seen > 32:
            raise ValueError(f"$ref {ref!r} does not resolve to a schema")
    return schema


def check(schema: Schema, where: str) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: a schema must be an object or a boolean")
    bad = sorted(UNSUPPORTED & schema.keys())
    if bad:
        raise ValueError(f"{where}: {bad[0]!r} cannot be enforced in this tool-call syntax")


def rust_is_string(schema: Schema) -> bool:
    """rust/text ``schema.rs``: ``"type": "string"``, or a list of string / null types."""
    if not isinstance(schema, dict):
        return False
    t = schema.get("type")
    if isinstance(t, str):
        return t == "string"
    if isinstance(t, list):
        return "string" in t and all(x in ("string", "null") for x in t)
    return False


def kind_of(schema: dict[str, Any]) -> str | list[str] | None:
    """The schema's type, or the one its keywords imply."""
    if "type" in schema:
        return schema["type"]
    if "properties" in schema or "additionalProperties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    if any(k in schema for k in ("minLength", "maxLength", "pattern")):
        return "string"
    return None


def object_parts(
    schema: dict[str, Any],
) -> tuple[list[tuple[str, Schema, bool]], Schema | None]:
    """An object schema's declared properties (name, schema, required) in order, and the
    schema of free keys when it declares none (None: no free keys)."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    out = [(k, v, k in required) for k, v in props.items()]
    out += [(k, True, True) for k in schema.get("required") or () if k not in props]
    extra = schema.get("additionalProperties", True)
    free = None if props or extra is False else (True if extra is True else extra)
    return out, free


def listing(r: Rules, items: list[tuple[str, bool]], sep: str, *, free: str | None = None) -> str:
    """Grammar for ``items`` (grammar, required) in order, optional ones left out or not,
    ``sep`` between the items written; then, with ``free``, any number of ``free`` items."""
    memo: dict[tuple[int, bool], str] = {}
    join = f"{sep} " if sep != '""' else ""

    def rest(i: int, after: bool) -> str:
        if i == len(items):
            if free is None:
                return '""'
            first = f"{join}{free}" if after else free
            return f"({first} ({join}{free})*)?"
        if (i, after) not in memo:
            g, req = items[i]
            taken = f"{join if after else ''}{g} {rest(i + 1, True)}"
            memo[i, after] = r.rule(taken if req else f"{taken} | {rest(i + 1, after)}")
        return memo[i, after]

    return rest(0, False)


def counted(item: str, sep: str, lo: int, hi: int | None) -> str:
    """``lo`` to ``hi`` (None: any number) copies of ``item``, ``sep`` between them."""
    if hi is not None and hi < lo:
        raise ValueError(f"maxItems {hi} is below minItems {lo}")
    if hi == 0:
        return '""'
    more_lo = max(lo - 1, 0)
    more_hi = "" if hi is None else str(hi - 1)
    body = f"{item} ({sep} {item}){{{more_lo},{more_hi}}}" if more_hi != "0" else item
    return body if lo >= 1 else f"({body})?"


# ---- values written as literals of a language (Gemma 4, Python) -----------


@dataclass(frozen=True)
class Literals:
    """How a language writes JSON values: Gemma 4's argument syntax, Python literals."""

    true: str
    false: str
    null: str
    item_sep: str  # between array items and object members
    key_sep: str  # between an object key and its value
    #: an object key as text, or None when the language cannot write it
    key: Callable[[str], str | None]
    #: the grammar of a free object key (with no separator)
    free_key: str
    #: the string quote, one (possibly escaped) character of a string, one unescaped one
    quote: str
    string_char: str
    plain_char: str
    escape: Callable[[str], str]

    def value(self, r: Rules, root: Schema, schema: Schema, where: str) -> str:
        """Grammar of one value matching ``schema`` (``root``: where ``$ref`` points)."""
        if isinstance(schema, dict) and "$ref" in schema:
            key = ("ref", id(self), schema["$ref"])
            if key in r._memo:
                return r._memo[key]
            # A named rule first, so that recursive schemas terminate.
            name = f"ref{len(r._memo) + 1}"
            r._memo[key] = name
            body = self.value(r, root, resolve(root, schema), where)
            r.lines.append(f"{name}: {body}")
            return name
        check(schema, where)
        if schema is True or schema == {}:
            return self.any(r)
        if schema is False:
            raise ValueError(f"{where}: the schema false accepts no value")
        if "const" in schema:
            return self.const(r, schema["const"], where)
        if "enum" in schema:
            return "(" + " | ".join(self.const(r, v, where) for v in schema["enum"]) + ")"
        base = {k: v for k, v in schema.items() if k not in (*_COMBINE, "allOf")}
        for key in _COMBINE:
            if key in schema:
                alts = [
                    self.value(r, root, merge(base, resolve(root, s)), where) for s in schema[key]
                ]
                return "(" + " | ".join(alts) + ")"
        if "allOf" in schema:
            merged = base
            for s in schema["allOf"]:
                merged = merge(merged, resolve(root, s))
            return self.value(r, root, merged, where)
        kind = kind_of(schema)
        if isinstance(kind, list):
            return (
                "("
                + " | ".join(self.value(r, root, {**schema, "type": t}, where) for t in kind)
                + ")"
            )
        if kind is None:
            return self.any(r)
        if kind == "string":
            return self.string(r, schema)
        if kind in ("integer", "number"):
            return r.json({k: v for k, v in schema.items() if k not in ("title", "description")})
        if kind == "boolean":
            return f"({_q(self.true)} | {_q(self.false)})"
        if kind == "null":
            return _q(self.null)
        if kind == "object":
            return self.obj(r, root, schema, where)
        if kind == "array":
            return self.array(r, root, schema, where)
        raise ValueError(f"{where}: unknown type {kind!r}")

    def const(self, r: Rules, v: Any, where: str) -> str:
        if isinstance(v, str):
            return r.lit(self.quote + self.escape(v) + self.quote)
        if isinstance(v, bool):
            return _q(self.true if v else self.false)
        if v is None:
            return _q(self.null)
        if isinstance(v, (int, float)):
            return _q(orjson.dumps(v).decode())
        if isinstance(v, list):
            inner = f" {_q(self.item_sep)} ".join(self.const(r, x, where) for x in v)
            return f'"[" {inner} "]"' if v else '"[]"'
        if isinstance(v, dict):
            parts = []
            for k, x in v.items():
                kt = self.key(k)
                if kt is None:
                    raise ValueError(f"{where}: key {k!r} cannot be written here")
                parts.append(f"{r.lit(kt)} {_q(self.key_sep)} {self.const(r, x, where)}")
            inner = f" {_q(self.item_sep)} ".join(parts)
            return f'"{{" {inner} "}}"'
        raise ValueError(f"{where}: a constant {v!r} is not JSON")

    def string(self, r: Rules, schema: dict[str, Any]) -> str:
        """A quoted string: ``quote`` text ``quote`` (lengths count escapes as one character)."""
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        pattern = schema.get("pattern")
        # Text under a pattern is written without escapes (they would change what it says).
        char = self.string_char if pattern is None else self.plain_char
        tok = r.is_token(self.quote)
        # Between two special-token quotes the text is its own lexeme, never empty.
        first = max(lo, 1) if tok else lo
        content = f"/({char}){{{first},{'' if hi is None else int(hi)}}}/ & {without(*MARKER_TEXT)}"
        if pattern is not None:
            content = f"/{pattern_rx(pattern)}/ & {content}"
        key = ("str", id(self), pattern, lo, hi)
        if not tok:
            return r.rule(f"{_q(self.quote)} ({content}) {_q(self.quote)}", key, terminal=True)
        q = r.lit(self.quote)
        text = r.rule(content, key, terminal=True)
        empty_ok = lo == 0 and (pattern is None or re.search(pattern, "") is not None)
        return f"{q} {text}{'?' if empty_ok else ''} {q}"

    def obj(self, r: Rules, root: Schema, schema: dict[str, Any], where: str) -> str:
        parts, free = object_parts(schema)
        items = []
        for k, s, req in parts:
            kt = self.key(k)
            if kt is None:
                raise ValueError(f"{where}: property {k!r} cannot be written in this syntax")
            items.append((f"{r.lit(kt)} {_q(self.key_sep)} {self.value(r, root, s, where)}", req))
        free_g = None
        if free is not None:
            free_g = f"{self.free_key} {_q(self.key_sep)} {self.value(r, root, free, where)}"
        return f'"{{" {listing(r, items, _q(self.item_sep), free=free_g)} "}}"'

    def array(self, r: Rules, root: Schema, schema: dict[str, Any], where: str) -> str:
        lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
        prefix = schema.get("prefixItems") or []
        rest = schema.get("items", True)
        if prefix:
            elems = [(self.value(r, root, s, where), i < lo) for i, s in enumerate(prefix)]
            if rest is not False and (hi is None or hi > len(prefix)):
                more = None if hi is None else int(hi) - len(prefix)
                free = self.value(r, root, rest, where)
                if more is not None:
                    elems += [(free, len(prefix) + i < lo) for i in range(more)]
                    inner = listing(r, elems, _q(self.item_sep))
                else:
                    inner = listing(r, elems, _q(self.item_sep), free=free)
            else:
                inner = listing(r, elems[: hi if hi is not None else None], _q(self.item_sep))
            return f'"[" {inner} "]"'
        item = self.value(r, root, rest, where)
        inner = counted(item, _q(self.item_sep), lo, None if hi is None else int(hi))
        return f'"[" {inner} "]"'

    def any(self, r: Rules) -> str:
        """Any JSON value."""
        key = ("any", id(self))
        if key in r._memo:
            return r._memo[key]
        name = f"any{len(r._memo) + 1}"
        r._memo[key] = name
        s = self.string(r, {})
        num = r.json({"type": "number"})
        sep = _q(self.item_sep)
        member = f"{self.free_key} {_q(self.key_sep)} {name}"
        r.lines.append(
            f"{name}: {s} | {num} | {_q(self.true)} | {_q(self.false)} | {_q(self.null)}"
            f' | "[" ({name} ({sep} {name})*)? "]" | "{{" ({member} ({sep} {member})*)? "}}"'
        )
        return name


def merge(a: Schema, b: Schema) -> Schema:
    """Two schemas that must both hold, as one (keywords of ``b`` win where both say)."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    out = {**a, **b}
    if "properties" in a and "properties" in b:
        out["properties"] = {**a["properties"], **b["properties"]}
    if "required" in a and "required" in b:
        out["required"] = [*a["required"], *[k for k in b["required"] if k not in a["required"]]]
    return out


def _py_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_GEMMA_BARE = re.compile(r"[^\s{}\[\],:<]([^{}\[\],:<]*[^\s{}\[\],:<])?\Z")
GEMMA_QUOTE = '<|"|>'

#: Python literals, as rust/text formats/pythonic.rs reads them.
PYTHON = Literals(
    true="True",
    false="False",
    null="None",
    item_sep=", ",
    key_sep=": ",
    key=lambda k: '"' + _py_escape(k) + '"',
    free_key='/"[A-Za-z_][A-Za-z0-9_]*"/',
    quote='"',
    string_char=r'[^"\\\n]|\\[\\"nt]',
    plain_char=r'[^"\\\n]',
    escape=_py_escape,
)

#: Gemma 4's argument syntax (formats/gemma.rs): bare keys, ``<|"|>`` strings.
GEMMA = Literals(
    true="true",
    false="false",
    null="null",
    item_sep=",",
    key_sep=":",
    key=lambda k: (
        k if _GEMMA_BARE.match(k) else (None if GEMMA_QUOTE in k else GEMMA_QUOTE + k + GEMMA_QUOTE)
    ),
    free_key="/[A-Za-z_][A-Za-z0-9_]*/",
    quote=GEMMA_QUOTE,
    string_char=r"(?s:.)",
    plain_char=r"(?s:.)",
    escape=lambda s: s,
)


# ---- values written as raw text between tags (Qwen3-Coder, GLM-4.5, MiniMax) ---


@dataclass(frozen=True)
class RawValues:
    """Argument values as raw text up to a closing tag, typed by the parser.

    ``term``: the text that ends a value; ``forbid``: text a value may not
    hold (the tags that would end it or its call early); ``json_first``: the
    parser reads any value that parses as JSON as JSON (Qwen3-Coder), else it
    keeps string parameters' text (:func:`rust_is_string`); ``trims``: one
    newline at each end of a value is layout (MiniMax), so a raw string may
    not start or end with one.
    """

    term: str
    forbid: tuple[str, ...]
    json_first: bool = False
    trims: bool = False

    def value(self, r: Rules, schema: Schema, where: str) -> str:
        """Grammar of one value and its closing tag.

        A parameter the parser keeps as text (:func:`rust_is_string`, not
        ``json_first``) is raw text; any other is read as JSON when it parses
        as JSON, so it is JSON under its schema, or raw text that cannot parse
        as JSON where the schema admits a string (``celsius`` for an enum)."""
        check(schema, where)
        if rust_is_string(schema) and not self.json_first:
            return self.raw(r, schema, where, exact=True)
        js = f"{r.json(schema)} {r.lit(self.term)}"
        text = string_view(schema)
        return f"({self.raw(r, text, where, exact=False)} | {js})" if text is not None else js

    def raw(self, r: Rules, schema: dict[str, Any], where: str, *, exact: bool) -> str:
        """Raw text for a string ``schema`` and the closing tag, as one lexeme.

        Not ``exact``: the parser tries JSON first (and GLM / MiniMax trim
        such a value), so the text must not parse as JSON nor end in space."""
        ands = [without(*self.forbid, *MARKER_TEXT)]
        if not exact:
            ands += [r'~/[\s{\["\-0-9](?s:.*)/', r"~/(true|false|null)\s*/"]
            if not self.json_first:
                ands.append(r"~/(?s:.*)\s/")
        if self.trims:
            ands += [r"~/\n(?s:.*)/", r"~/(?s:.*)\n/"]
        if "enum" in schema or "const" in schema:
            vals = schema["enum"] if "enum" in schema else [schema["const"]]
            strs = [v for v in vals if isinstance(v, str)]
            if not strs:
                raise ValueError(f"{where}: no string among the allowed values")
            base = "/(" + "|".join(rx(v) for v in strs) + ")/"
        elif "pattern" in schema:
            base = f"/{pattern_rx(schema['pattern'])}/"
        else:
            base = "/(?s:.*)/"
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        if lo or hi is not None:
            ands.append(f"/(?s:.){{{lo},{'' if hi is None else int(hi)}}}/")
        content = " & ".join([base, *ands])
        key = ("raw", self, orjson.dumps(schema, option=orjson.OPT_SORT_KEYS))
        return r.rule(f"({content}) {_q(self.term)}", key, terminal=True)


def string_view(schema: Schema) -> dict[str, Any] | None:
    """The strings ``schema`` admits, as a string schema (None: none, or not simply said)."""
    if schema is True or schema == {}:
        return {}
    if not isinstance(schema, dict) or any(k in schema for k in (*_COMBINE, "allOf", "$ref")):
        return None
    if "enum" in schema or "const" in schema:
        vals = schema["enum"] if "enum" in schema else [schema["const"]]
        strs = [v for v in vals if isinstance(v, str)]
        return {"enum": strs} if strs else None
    kind = kind_of(schema)
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return {**schema, "type": "string"}
    return None


# ---- one table: how each family writes its calls -------------------------


@dataclass(frozen=True)
class Syntax:
    """How one family writes tool calls.

    Forced: ``lead? open head call (sep call)* tail`` (one call when ``sep``
    is None or parallel calls are off). ``call(r, tool)`` is the grammar of
    one call of ``tool``; ``markers`` are matched as special tokens where the
    tokenizer has them. ``open`` is what a strict-tools grammar under
    ``auto`` waits for (None: the family has no opening tag).
    """

    open: str | None
    head: str
    sep: str | None
    tail: str
    call: Callable[[Rules, Tool], str]
    markers: tuple[str, ...] = ()
    lead: Callable[[Rules], str] | None = None


def _args(tool: Tool) -> Schema:
    return tool.parameters or {"type": "object"}


def _name(tool: Tool, ok: Callable[[str], bool], family: str) -> str:
    if not ok(tool.name):
        raise ValueError(f"the tool name {tool.name!r} cannot be written in {family}'s call syntax")
    return tool.name


def _plain_name(n: str) -> bool:
    """rust/text formats/bodies.rs ``name_ok``, and no surrounding whitespace."""
    return bool(n) and n == n.strip() and not any(c in n for c in "<>\n{}")


def _json_call(args_key: str) -> Callable[[Rules, Tool], str]:
    """``{"name": N, args_key: {..}}`` as one JSON value (Hermes, Llama 3, Mistral)."""

    def call(r: Rules, t: Tool) -> str:
        args = dict(_args(t))
        # The arguments' definitions move to the root, where their "#/$defs/.." point.
        defs = {k: args.pop(k) for k in ("$defs", "definitions") if k in args}
        return r.json(
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, args_key: args},
                "required": ["name", args_key],
                "additionalProperties": False,
                **defs,
            }
        )

    return call


def _pairs(
    r: Rules,
    t: Tool,
    pair: Callable[[str], str],
    ok: Callable[[str], bool],
    values: RawValues,
    family: str,
) -> str:
    """The arguments of a raw-value family: ``pair(key)`` then the value, per property
    (free keys where the schema declares none)."""
    schema = resolve(_args(t), _args(t))
    check(schema, t.name)
    if not isinstance(schema, dict):
        schema = {}
    r.defs = schema.get("$defs") or schema.get("definitions") or {}
    props, free = object_parts(schema)
    items = []
    for k, s, req in props:
        if not ok(k):
            raise ValueError(f"{t.name}: the parameter name {k!r} cannot be written in {family}")
        items.append((f"{r.lit(pair(k))} {values.value(r, s, t.name)}", req))
    free_g = None
    if free is not None:
        key = r.rule(r"/[A-Za-z_][A-Za-z0-9_]*/", ("freekey",), terminal=True)
        before, _, after = pair("\x00").partition("\x00")
        free_g = f"{r.lit(before)} {key} {r.lit(after)} {values.value(r, free, t.name)}"
    return listing(r, items, '""', free=free_g)


def _key_ok(bad: str) -> Callable[[str], bool]:
    return lambda k: bool(k) and k == k.strip() and not any(c in k for c in bad)


#: Qwen3-Coder reads a value as JSON whenever it parses (rust/text toolcall.rs).
_QWEN3_VALUES = RawValues(
    "\n</parameter>\n", ("</parameter>", "</function>", "</tool_call>"), json_first=True
)
_GLM_VALUES = RawValues("</arg_value>", ("</arg_value>", "</tool_call>"))
_MINIMAX_VALUES = RawValues(
    "</parameter>\n", ("</parameter>", "</invoke>", "</minimax:tool_call>"), trims=True
)


def _qwen3_call(r: Rules, t: Tool) -> str:
    name = _name(t, lambda n: _plain_name(n) and "=" not in n, "qwen3_coder")
    args = _pairs(
        r, t, lambda k: f"<parameter={k}>\n", _key_ok("<>\n"), _QWEN3_VALUES, "qwen3_coder"
    )
    return f"{r.lit(f'<function={name}>' + chr(10))} {args} {r.lit('</function>')}"


def _glm_call(r: Rules, t: Tool) -> str:
    name = _name(t, _plain_name, "glm45")
    args = _pairs(
        r,
        t,
        lambda k: f"\n<arg_key>{k}</arg_key>\n<arg_value>",
        _key_ok("<"),
        _GLM_VALUES,
        "glm45",
    )
    return f"{r.lit(name)} {args}"


def _minimax_call(r: Rules, t: Tool) -> str:
    bad = '<>"\n'
    name = _name(t, lambda n: _plain_name(n) and not any(c in n for c in bad), "minimax_m2")
    args = _pairs(
        r, t, lambda k: f'<parameter name="{k}">', _key_ok(bad), _MINIMAX_VALUES, "minimax_m2"
    )
    # Each parameter ends on its own line, as the template writes it.
    return (
        f"{r.lit(f'<invoke name={chr(34)}{name}{chr(34)}>' + chr(10))} {args} {r.lit('</invoke>')}"
    )


def _deepseek_call(r: Rules, t: Tool) -> str:
    name = _name(t, _plain_name, "deepseek_v3")
    args = r.json(_args(t))
    v31 = f"{r.lit(name + DS_SEP)} {args}"
    v3 = f"{r.lit('function' + DS_SEP + name + chr(10) + '```json' + chr(10))} {args} {r.lit(chr(10) + '```')}"
    return f"{r.lit(DS_CALL)} ({v31} | {v3}) {r.lit(DS_CALL_END)}"


DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _kimi_call(r: Rules, t: Tool) -> str:
    name = _name(t, lambda n: _plain_name(n) and ":" not in n, "kimi_k2")
    idx = r.rule("/0|[1-9][0-9]?/", ("kimi_idx",), terminal=True)
    head = r.lit(f"<|tool_call_begin|>functions.{name}:")
    return f"{head} {idx} {r.lit('<|tool_call_argument_begin|>')} {r.json(_args(t))} {r.lit('<|tool_call_end|>')}"


def _harmony_call(r: Rules, t: Tool) -> str:
    ok = lambda n: bool(n) and all(c.isascii() and (c.isalnum() or c in "_.-:/@") for c in n)  # noqa: E731
    name = _name(t, ok, "harmony")
    head = r.lit(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>")
    return f"{head} {r.json(_args(t))}"


def _harmony_lead(r: Rules) -> str:
    """gpt-oss reasons in its analysis channel first (free text), or not."""
    text = r.rule(f"/(?s:.*)/ & {without('<|')}", ("harmony_analysis",), terminal=True)
    return (
        f"({r.lit('<|channel|>analysis<|message|>')} {text}? {r.lit('<|end|><|start|>assistant')})?"
    )


def _gemma_call(r: Rules, t: Tool) -> str:
    name = _name(t, lambda n: _plain_name(n) and ":" not in n, "gemma4")
    schema = _args(t)
    return f"{r.lit('call:' + name)} {GEMMA.value(r, schema, schema, t.name)}"


def _python_call(r: Rules, t: Tool) -> str:
    name = _name(t, lambda n: all(_IDENT.match(p) for p in n.split(".")), "pythonic")
    schema = resolve(_args(t), _args(t))
    check(schema, t.name)
    props, free = object_parts(schema) if isinstance(schema, dict) else ([], True)
    items = []
    for k, s, req in props:
        if not _IDENT.match(k):
            raise ValueError(f"{t.name}: the parameter name {k!r} is not a Python identifier")
        items.append((f"{_q(k + '=')} {PYTHON.value(r, schema, s, t.name)}", req))
    free_g = None
    if free is not None:
        key = r.rule("/[A-Za-z_][A-Za-z0-9_]*/", ("pykey",), terminal=True)
        free_g = f'{key} "=" {PYTHON.value(r, schema, free, t.name)}'
    return f'{_q(name + "(")} {listing(r, items, _q(", "), free=free_g)} ")"'


#: family -> how it writes calls. The families without an entry get no grammar.
SYNTAXES: dict[str, Syntax] = {
    "hermes": Syntax(
        "<tool_call>", "\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>", _json_call("arguments")
    ),
    "llama3": Syntax(None, "", "; ", "", _json_call("parameters")),
    "mistral": Syntax(
        "[TOOL_CALLS]", "[", ", ", "]", _json_call("arguments"), markers=("[TOOL_CALLS]",)
    ),
    "qwen3_coder": Syntax(
        "<tool_call>", "\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>", _qwen3_call
    ),
    "glm45": Syntax("<tool_call>", "", "\n</tool_call>\n<tool_call>", "\n</tool_call>", _glm_call),
    "minimax_m2": Syntax(
        "<minimax:tool_call>",
        "\n",
        "\n",
        "\n</minimax:tool_call>",
        _minimax_call,
        markers=("<minimax:tool_call>", "</minimax:tool_call>"),
    ),
    "deepseek_v3": Syntax(
        DS_CALLS, "", "\n", DS_CALLS_END, _deepseek_call,
        markers=(DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP),
    ),
    "kimi_k2": Syntax(
        "<|tool_calls_section_begin|>", "", "", "<|tool_calls_section_end|>", _kimi_call,
        markers=(
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>",
        ),
    ),
    "harmony": Syntax(
        None, "", None, "", _harmony_call,
        markers=("<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|start|>"),
        lead=_harmony_lead,
    ),
    "gemma4": Syntax(
        "<|tool_call>", "", "<tool_call|><|tool_call>", "<tool_call|>", _gemma_call,
        markers=("<|tool_call>", "<tool_call|>", GEMMA_QUOTE),
    ),
    "pythonic": Syntax(None, "[", ", ", "]", _python_call),
}  # fmt: skip


def _calls(syn: Syntax, r: Rules, tools: list[Tool], parallel: bool) -> str:
    """``head call (sep call)* tail``: the grammar after the opening tag."""
    one = r.rule(" | ".join(syn.call(r, t) for t in tools), ("call",))
    more = f" ({r.lit(syn.sep)} {one})*" if parallel and syn.sep is not None else ""
    head = f"{r.lit(syn.head)} " if syn.head else ""
    tail = f" {r.lit(syn.tail)}" if syn.tail else ""
    return f"{head}{one}{more}{tail}"


def forced(
    family: str | None,
    tools: list[Tool],
    *,
    parallel: bool,
    specials: Mapping[str, int],
    styled: Callable,
) -> str | None:
    """The grammar of one (``parallel``: one or more) call of ``tools`` in ``family``'s syntax."""
    syn = SYNTAXES.get(family or "")
    if syn is None or not tools:
        return None
    r = Rules(specials, syn.markers, styled)
    body = _calls(syn, r, tools, parallel)
    opener = f"{r.lit(syn.open)} " if syn.open else ""
    lead = f"{syn.lead(r)} " if syn.lead else ""
    return f"start: {lead}{opener}{body}\n{r.text()}"


def lazy(
    family: str | None,
    tools: list[Tool],
    *,
    parallel: bool,
    specials: Mapping[str, int],
    eos: Iterable[int],
    styled: Callable,
) -> str | None:
    """``auto`` with strict tools: free text, or text then calls once the opening tag is
    written (None: the family has no opening tag). Special tokens other than the
    opening tag and the end of turn stay free in the text (reasoning tags, channels)."""
    syn = SYNTAXES.get(family or "")
    if syn is None or syn.open is None or not tools:
        return None
    r = Rules(specials, (*syn.markers, syn.open), styled)
    body = _calls(syn, r, tools, parallel)
    free_ids = sorted(set(specials.values()) - set(eos) - set(r.tokens.values()))
    sp = r.rule(f"<[{_ranges(free_ids)}]>") if free_ids else None
    if r.is_token(syn.open):
        text = r.rule("/(?s:.*)/", terminal=True)
        free = f"{text}? ({sp} {text}?)*" if sp else f"{text}?"
        return f"start: {free} | {free} {r.lit(syn.open)} {body}\n{r.text()}"
    text = r.rule(f"/(?s:.*)/ & {without(syn.open)}", terminal=True)
    free = f"{text}? ({sp} {text}?)*" if sp else f"{text}?"
    before = f"({text}? {sp})* " if sp else ""
    opened = f"opened[suffix={_q(syn.open)}]: /(?s:.*)/"
    return f"start: {free} | {before}opened {body}\n{opened}\n{r.text()}"


def _ranges(ids: list[int]) -> str:
    """Sorted token ids as llguidance token ranges: ``1-3,7``."""
    out: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)
