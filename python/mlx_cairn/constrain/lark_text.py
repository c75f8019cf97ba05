"""Building llguidance Lark grammars as text: named rules, literals, special tokens, regexes.

Used by :mod:`mlx_cairn.constrain.tool_grammars` (each family's tool-call grammar) and
:mod:`mlx_cairn.constrain.tool_values` (how argument values are written). Two facts of
llguidance's lexer shape everything here:

- A lexeme is greedy: text that may go on (a raw value) cannot be followed
  by a separate literal it could itself contain, so such text and the tag
  that ends it are one lexeme (:meth:`Rules.until`).
- Text regexes never produce special tokens; a special token is ``<[id]>``.

Example::

    r = Rules({"<|end|>": 7}, ["<|end|>"], styled)
    r.lit("done<|end|>")                      # '"done" <[7]>'
    r.until("/(?s:.*)/", "\\n</parameter>")  # one lexeme: text then the tag
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson

Schema = Any  # a JSON Schema: a dict, or True / False


class Rules:
    """A grammar under construction.

    ``specials``: the tokenizer's special tokens (text -> id); ``markers``:
    the family texts matched as a token when the tokenizer has them;
    ``styled(schema)``: a schema as ``%json`` text with the output style.
    """

    def __init__(
        self, specials: Mapping[str, int], markers: Iterable[str], styled: Callable[[Any], str]
    ) -> None:
        self.styled = styled
        self.lines: list[str] = []
        self._memo: dict[Any, str] = {}
        self._n = 0
        self.tokens = {m: specials[m] for m in markers if m in specials}
        by_length = sorted(self.tokens, key=len, reverse=True)
        self._split = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        #: the current tool schema's definitions, for the schemas embedded with %json
        self.defs: dict[str, Any] = {}

    def name(self, key: Any, prefix: str = "r") -> tuple[str, bool]:
        """The rule name for ``key`` and whether it is new (define it then)."""
        if key is not None and key in self._memo:
            return self._memo[key], False
        self._n += 1
        n = f"{prefix}{self._n}"
        if key is not None:
            self._memo[key] = n
        return n, True

    def rule(self, body: str, key: Any = None, *, terminal: bool = False) -> str:
        """A rule (``terminal``: a lexeme) for ``body``; the same ``key`` gives the same rule."""
        n, new = self.name(key, "T" if terminal else "r")
        if new:
            self.define(n, body)
        return n

    def define(self, name: str, body: str) -> None:
        self.lines.append(f"{name}: {body}")

    def parts(self, text: str) -> list[tuple[bool, str]]:
        """``text`` cut into (is a special token, text) pieces."""
        if self._split is None:
            return [(False, text)] if text else []
        out: list[tuple[bool, str]] = []
        pos = 0
        for m in self._split.finditer(text):
            if m.start() > pos:
                out.append((False, text[pos : m.start()]))
            out.append((True, m.group()))
            pos = m.end()
        if pos < len(text):
            out.append((False, text[pos:]))
        return out

    def lit(self, text: str) -> str:
        """``text`` as grammar: quoted literals, the special-token markers as ``<[id]>``."""
        if not text:
            return '""'
        return " ".join(f"<[{self.tokens[t]}]>" if tok else q(t) for tok, t in self.parts(text))

    def is_token(self, text: str) -> bool:
        return text in self.tokens

    def until(self, content: str, end: str, *, empty: bool = True, key: Any = None) -> str:
        """Text matching the regex term ``content``, then ``end``.

        The text and the literal start of ``end`` are one lexeme (the text may
        hold what ``end`` starts with); a special token ends the text by itself.
        ``empty``: the text may be empty (between special tokens).
        """
        parts = self.parts(end)
        if parts and not parts[0][0]:
            head, rest = parts[0][1], parts[1:]
            text = self.rule(f"({content}) {q(head)}", key, terminal=True)
        else:
            rest = parts
            text = self.rule(content, key, terminal=True) + ("?" if empty else "")
        tail = " ".join(f"<[{self.tokens[t]}]>" if tok else q(t) for tok, t in rest)
        return f"{text} {tail}".strip()

    def json(self, schema: Schema) -> str:
        """A JSON value matching ``schema`` (llguidance's JSON Schema compiler)."""
        if schema is True:
            schema = {}
        if isinstance(schema, dict) and self.defs and "$defs" not in schema:
            schema = {**schema, "$defs": self.defs}
        return self.rule(f"%json {self.styled(schema)}", ("json", orjson.dumps(schema)))

    def text(self) -> str:
        return "\n".join([*self.lines, ""])


def q(text: str) -> str:
    """``text`` as a quoted grammar literal."""
    return orjson.dumps(text).decode()


_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")
_REGEX_CONTROL = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def rx(text: str) -> str:
    """``text`` as a literal inside a grammar regex (``/../``)."""
    return "".join(_REGEX_CONTROL.get(c) or ("\\" + c if c in _REGEX_META else c) for c in text)


def without(*texts: str) -> str:
    """A regex term: text that contains none of ``texts``."""
    return f"~/(?s:.*)({'|'.join(rx(t) for t in texts)})(?s:.*)/"


def pattern_rx(pattern: str) -> str:
    """A JSON Schema ``pattern`` (a search, anchored only by ``^`` / ``$``) as a whole-text regex."""
    p = pattern.replace("/", "\\/")
    start = p.startswith("^")
    end = p.endswith("$") and not p.endswith("\\$")
    p = p[1 if start else 0 : len(p) - 1 if end else len(p)]
    return f"{'' if start else '(?s:.*)'}({p}){'' if end else '(?s:.*)'}"


def listing(r: Rules, items: list[tuple[str, bool]], sep: str, *, free: str | None = None) -> str:
    """Grammar for ``items`` (grammar, required) in order, the optional ones written or
    not, ``sep`` between the items written; then, with ``free``, any number of those."""
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
    more_hi = "" if hi is None else str(hi - 1)
    body = f"{item} ({sep} {item}){{{max(lo - 1, 0)},{more_hi}}}" if more_hi != "0" else item
    return body if lo >= 1 else f"({body})?"


def token_ranges(ids: Iterable[int]) -> str:
    """Token ids as llguidance token ranges: ``1-3,7``."""
    s = sorted(set(ids))
    out: list[str] = []
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(out)
