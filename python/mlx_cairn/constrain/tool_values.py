"""How tool-call argument values are written in the syntaxes that are not JSON.

:mod:`mlx_cairn.constrain.tool_grammars` writes each family's calls; the values in them
are one of:

- JSON under the value's schema (``%json``, llguidance's compiler): the JSON
  families, and every non-string raw value below;
- :class:`Literals`: a small language's literals for JSON values, Python's
  (``True``, ``None``, ``{"k": 1}``, pythonic calls) or Gemma 4's (bare keys,
  ``<|"|>`` strings), translated from the JSON Schema here;
- :class:`RawValues`: raw text up to a closing tag (Qwen3-Coder, GLM-4.5,
  MiniMax M2), typed back by the parser: GLM-4.5 and MiniMax keep a value as
  text when the tool's schema says its parameter is a string
  (:func:`rust_is_string`, the Rust rule) and read anything else as JSON when
  it parses; Qwen3-Coder reads any value that parses as JSON as JSON. So a
  string is raw text that cannot be mistaken for JSON (or a JSON string, which
  the JSON-first parser reads back exactly), and everything else is JSON.

Raw text never holds its family's tags (a closing one would end the value or
the call early), nor the markers the parsers drop (:data:`MARKER_TEXT`); text
with a length bound or a pattern holds no ``<`` at all (:func:`bounded_text`). Schema keywords that no
translation enforces (:data:`UNSUPPORTED`) are refused, so a forced call
never silently drops part of its schema; ``format`` is an annotation in JSON
Schema and is not enforced in raw text.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from mlx_cairn.constrain.lark_text import (
    Rules,
    Schema,
    counted,
    listing,
    pattern_rx,
    q,
    rx,
    without,
)

#: Text the parsers drop or read as structure wherever it appears (end-of-turn
#: and role markers): raw values never hold it.
MARKER_TEXT = ("<|", "<end_of_turn>", "<start_of_turn>", "<｜")


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
    """ValueError unless ``schema`` is a schema whose keywords the translations here enforce."""
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


def bounded_text(lo: int, hi: int | None, pattern: str | None, forbid: tuple[str, ...]) -> str:
    """A regex term for text of ``lo`` to ``hi`` characters matching ``pattern``, holding
    none of ``forbid`` (which all start with ``<``).

    Free text excludes exactly ``forbid``. Counted or patterned text holds no ``<``
    at all: a length counter times the automaton of several excluded words grows
    past llguidance's lexer budget over a 49k vocabulary ("too many expressions
    constructed"), while text without one character costs nothing extra.
    """
    if not lo and hi is None and pattern is None:
        return f"/(?s:.*)/ & {without(*forbid)}"
    assert all(f.startswith("<") for f in forbid), forbid
    text = f"/[^<]{{{lo},{'' if hi is None else int(hi)}}}/"
    return f"/{pattern_rx(pattern)}/ & {text}" if pattern is not None else text


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
            # Named before it is defined, so that recursive schemas terminate.
            name, new = r.name(("ref", self, orjson.dumps(schema)), "ref")
            if new:
                r.define(name, self.value(r, root, resolve(root, schema), where))
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
            return f"({q(self.true)} | {q(self.false)})"
        if kind == "null":
            return q(self.null)
        if kind == "object":
            return self.obj(r, root, schema, where)
        if kind == "array":
            return self.array(r, root, schema, where)
        raise ValueError(f"{where}: unknown type {kind!r}")

    def const(self, r: Rules, v: Any, where: str) -> str:
        if isinstance(v, str):
            return r.lit(self.quote + self.escape(v) + self.quote)
        if isinstance(v, bool):
            return q(self.true if v else self.false)
        if v is None:
            return q(self.null)
        if isinstance(v, (int, float)):
            return q(orjson.dumps(v).decode())
        if isinstance(v, list):
            inner = f" {q(self.item_sep)} ".join(self.const(r, x, where) for x in v)
            return f'"[" {inner} "]"' if v else '"[]"'
        if isinstance(v, dict):
            parts = []
            for k, x in v.items():
                kt = self.key(k)
                if kt is None:
                    raise ValueError(f"{where}: key {k!r} cannot be written here")
                parts.append(f"{r.lit(kt)} {q(self.key_sep)} {self.const(r, x, where)}")
            inner = f" {q(self.item_sep)} ".join(parts)
            return f'"{{" {inner} "}}"'
        raise ValueError(f"{where}: a constant {v!r} is not JSON")

    def string(self, r: Rules, schema: dict[str, Any]) -> str:
        """A quoted string: ``quote`` text ``quote`` (lengths count escapes as one character)."""
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        pattern = schema.get("pattern")
        if pattern is None and not lo and hi is None:
            content = f"/({self.string_char})*/ & {without(*MARKER_TEXT)}"
        else:
            # Text under a pattern is written without escapes (they would change what
            # it says); counted text holds no "<" (see bounded_text).
            char = self.plain_char if pattern is not None else self.string_char
            content = f"/({char}){{{lo},{'' if hi is None else int(hi)}}}/ & /[^<]*/"
            if pattern is not None:
                content = f"/{pattern_rx(pattern)}/ & {content}"
        empty = lo == 0 and (pattern is None or re.search(pattern, "") is not None)
        key = ("str", self, pattern, lo, hi)
        return f"{r.lit(self.quote)} {r.until(content, self.quote, empty=empty, key=key)}"

    def obj(self, r: Rules, root: Schema, schema: dict[str, Any], where: str) -> str:
        parts, free = object_parts(schema)
        items = []
        for k, s, req in parts:
            kt = self.key(k)
            if kt is None:
                raise ValueError(f"{where}: property {k!r} cannot be written in this syntax")
            items.append((f"{r.lit(kt)} {q(self.key_sep)} {self.value(r, root, s, where)}", req))
        free_g = None
        if free is not None:
            free_g = f"{self.free_key} {q(self.key_sep)} {self.value(r, root, free, where)}"
        return f'"{{" {listing(r, items, q(self.item_sep), free=free_g)} "}}"'

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
                    inner = listing(r, elems, q(self.item_sep))
                else:
                    inner = listing(r, elems, q(self.item_sep), free=free)
            else:
                inner = listing(r, elems[: hi if hi is not None else None], q(self.item_sep))
            return f'"[" {inner} "]"'
        item = self.value(r, root, rest, where)
        inner = counted(item, q(self.item_sep), lo, None if hi is None else int(hi))
        return f'"[" {inner} "]"'

    def any(self, r: Rules) -> str:
        """Any JSON value."""
        name, new = r.name(("any", self), "any")
        if not new:
            return name
        s = self.string(r, {})
        num = r.json({"type": "number"})
        sep = q(self.item_sep)
        member = f"{self.free_key} {q(self.key_sep)} {name}"
        r.define(
            name,
            f"{s} | {num} | {q(self.true)} | {q(self.false)} | {q(self.null)}"
            f' | "[" ({name} ({sep} {name})*)? "]" | "{{" ({member} ({sep} {member})*)? "}}"',
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


IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
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
            text = self.raw(r, schema, where, exact=True)
            if text is None:
                raise ValueError(f"{where}: no allowed string can be written as a raw value")
            return text
        js = f"{r.json(schema)} {r.lit(self.term)}"
        view = string_view(schema)
        text = self.raw(r, view, where, exact=False) if view is not None else None
        return f"({text} | {js})" if text is not None else js

    def raw(self, r: Rules, schema: dict[str, Any], where: str, *, exact: bool) -> str | None:
        """Raw text for a string ``schema``, then the closing tag (None: no such text).

        Not ``exact``: the parser tries JSON first (and GLM / MiniMax trim
        such a value), so the text must not parse as JSON nor end in space."""
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        key = ("raw", self, exact, orjson.dumps(schema, option=orjson.OPT_SORT_KEYS))
        if "enum" in schema or "const" in schema:
            vals = schema["enum"] if "enum" in schema else [schema["const"]]
            strs = [v for v in vals if isinstance(v, str) and self._writable(v, exact)]
            if not strs:
                return None
            content = "/(" + "|".join(rx(v) for v in strs) + ")/"
            return r.until(content, self.term, empty="" in strs, key=key)
        ands = []
        if not exact:
            ands += [r'~/[\s{\["\-0-9](?s:.*)/', r"~/(true|false|null)\s*/"]
            if not self.json_first:
                ands.append(r"~/(?s:.*)\s/")
        if self.trims:
            ands += [r"~/\n(?s:.*)/", r"~/(?s:.*)\n/"]
        pattern = schema.get("pattern")
        content = " & ".join([bounded_text(lo, hi, pattern, (*self.forbid, *MARKER_TEXT)), *ands])
        empty = lo == 0 and (pattern is None or re.search(pattern, "") is not None)
        return r.until(content, self.term, empty=empty, key=key)

    def _writable(self, v: str, exact: bool) -> bool:
        """``v`` can be written raw here and reads back as this string."""
        if any(f in v for f in (*self.forbid, *MARKER_TEXT)):
            return False
        if self.trims and (v.startswith("\n") or v.endswith("\n")):
            return False
        return exact or self._safe(v)

    def _safe(self, v: str) -> bool:
        """``v`` reads back as this string where the parser tries JSON first."""
        try:
            orjson.loads(v)
        except orjson.JSONDecodeError:
            return self.json_first or v == v.rstrip()
        return False


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
