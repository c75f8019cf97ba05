"""Tool-call grammars in each parser family's own syntax (llguidance Lark).

A forced call (``tool_choice`` required / a named tool) and a strict tool
under ``auto`` are constrained in exactly the syntax the family's Rust parser
reads (``rust/text``: ``parser.rs``, ``toolcall.rs``, ``formats/``), as the
chat templates write it, so the parser turns the output into the call the
grammar allowed. The layout of each family's calls (the tag that opens them,
what comes around and between calls, its tags) is its entry's ``calls`` in the
table :mod:`mlx_cairn.tool_families`; :data:`WRITERS` write one call (the entry
names its writer), :data:`SYNTAXES` joins the two, and
:mod:`mlx_cairn.constrain.tool_values` says how argument values are::

    family       calls                                                            values
    hermes       <tool_call>\\n{"name": N, "arguments": {..}}\\n</tool_call>        JSON
    llama3       {"name": N, "parameters": {..}}; ..                              JSON
    mistral      [TOOL_CALLS][{"name": N, "arguments": {..}}, ..]                 JSON
    qwen3_coder  <tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>  raw
    glm45        <tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>  raw
    minimax_m2   <minimax:tool_call>\\n<invoke name="N">\\n<parameter name="K">V</parameter>\\n</invoke>\\n..  raw
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>{..}<｜tool▁call▁end｜>..<｜tool▁calls▁end｜>
                 (V3.1; V3's function<｜tool▁sep｜>N\\n```json\\n{..}\\n``` too)          JSON
    kimi_k2      <|tool_calls_section_begin|><|tool_call_begin|>functions.N:0<|tool_call_argument_begin|>{..}<|tool_call_end|>..
    harmony      [analysis message] <|channel|>commentary to=functions.N <|constrain|>json<|message|>{..}
                 (one call: <|call|> ends the turn)                               JSON
    gemma4       <|tool_call>call:N{k:<|"|>v<|"|>,n:1}<tool_call|>..                Gemma literals
    pythonic     [N(k="v", n=1), ..]                                              Python literals

Literal text that is a special token of the tokenizer (``[TOOL_CALLS]``,
``<|channel|>``, ``<|"|>``, GLM's ``<arg_key>``) is matched as that token
(``<[id]>``); the engine decodes these families with special tokens kept, so
the parser sees it.

Example::

    text = forced("glm45", tools, parallel=False, specials=tok.special_tokens, styled=styled)
    vocab.compile_lark(text)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mlx_cairn import tool_families
from mlx_cairn.constrain.lark_text import Rules, Schema, listing, q, token_ranges, without
from mlx_cairn.constrain.tool_values import (
    GEMMA,
    IDENT,
    PYTHON,
    RawValues,
    check,
    object_parts,
    resolve,
)
from mlx_cairn.types import Tool


@dataclass(frozen=True)
class Writer:
    """Writes one call (``call(r, tool)``: its grammar) and, for a family whose
    model may write something before its calls, that (``lead(r)``)."""

    call: Callable[[Rules, Tool], str]
    lead: Callable[[Rules], str] | None = None


@dataclass(frozen=True)
class Syntax:
    """How one family writes tool calls: its table entry's layout and its writer.

    Forced: ``lead? open head call (sep call)* tail`` (one call when ``sep``
    is None or parallel calls are off). ``call(r, tool)`` is the grammar of
    one call of ``tool``. ``open`` is what a strict-tools grammar under
    ``auto`` waits for (None: the family has no opening tag). ``markers``:
    the family's tags, matched as special tokens where the tokenizer has them.
    (:class:`mlx_cairn.tool_families.Calls` describes the fields.)
    """

    open: str | None
    head: str
    sep: str | None
    tail: str
    call: Callable[[Rules, Tool], str]
    markers: tuple[str, ...] = ()
    lead: Callable[[Rules], str] | None = None


def _args(tool: Tool) -> Schema:
    """The tool's arguments schema; an object whatever it says (every parser wants one)."""
    schema = tool.parameters or {}
    if isinstance(schema, dict) and "type" not in schema and "$ref" not in schema:
        schema = {**schema, "type": "object"}
    return schema


def _name(tool: Tool, ok: Callable[[str], bool], family: str) -> str:
    if not ok(tool.name):
        raise ValueError(f"the tool name {tool.name!r} cannot be written in {family}'s call syntax")
    return tool.name


def _plain_name(n: str) -> bool:
    """rust/text formats/bodies.rs ``name_ok``, and no surrounding whitespace."""
    return bool(n) and n == n.strip() and not any(c in n for c in "<>\n{}")


def _key_ok(bad: str) -> Callable[[str], bool]:
    return lambda k: bool(k) and k == k.strip() and not any(c in k for c in bad)


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


def _json_args(r: Rules, t: Tool) -> str:
    """The arguments as one JSON object (the families whose calls carry JSON)."""
    return r.json(_args(t))


def _pairs(
    r: Rules, t: Tool, pair: Callable[[str], str], ok: Callable[[str], bool], values: RawValues
) -> str:
    """A raw-value family's arguments: ``pair(key)`` then the value, per property in
    order (free keys where the schema declares none)."""
    schema = resolve(_args(t), _args(t))
    check(schema, t.name)
    schema = schema if isinstance(schema, dict) else {}
    r.defs = schema.get("$defs") or schema.get("definitions") or {}
    props, free = object_parts(schema)
    items = []
    for k, s, req in props:
        if not ok(k):
            raise ValueError(f"{t.name}: the parameter name {k!r} cannot be written in this syntax")
        items.append((f"{r.lit(pair(k))} {values.value(r, s, t.name)}", req))
    free_g = None
    if free is not None:
        key = r.rule(r"/[A-Za-z_][A-Za-z0-9_]*/", ("free key",), terminal=True)
        before, _, after = pair("\x00").partition("\x00")
        free_g = f"{r.lit(before)} {key} {r.lit(after)} {values.value(r, free, t.name)}"
    return listing(r, items, '""', free=free_g)


#: Raw values hold none of their family's tags: a closing tag would end the value
#: or its call early, and an opening one is what a model writes to start the next
#: parameter (text that looks like structure is read as structure).
#: Qwen3-Coder reads a value as JSON whenever it parses (rust/text toolcall.rs);
#: each value sits on lines of its own, as the template writes it.
QWEN3_VALUES = RawValues(
    "\n</parameter>\n",
    ("</parameter>", "</function>", "</tool_call>", "<parameter=", "<function=", "<tool_call>"),
    json_first=not tool_families.FAMILY["qwen3_coder"].schema_typed,
)
GLM_VALUES = RawValues(
    "</arg_value>", ("</arg_value>", "</tool_call>", "<arg_key>", "<arg_value>", "<tool_call>")
)
#: MiniMax drops one newline at each end of a value (formats/bodies.rs).
MINIMAX_VALUES = RawValues(
    "</parameter>\n",
    ("</parameter>", "</invoke>", "</minimax:tool_call>", "<parameter name=", "<invoke name="),
    trims=True,
)


def _qwen3_call(r: Rules, t: Tool) -> str:
    name = _name(t, lambda n: _plain_name(n) and "=" not in n, "qwen3_coder")
    args = _pairs(r, t, lambda k: f"<parameter={k}>\n", _key_ok("<>\n"), QWEN3_VALUES)
    return f"{r.lit(f'<function={name}>' + chr(10))} {args} {r.lit('</function>')}"


def _glm_call(r: Rules, t: Tool) -> str:
    name = _name(t, _plain_name, "glm45")
    pair = lambda k: f"\n<arg_key>{k}</arg_key>\n<arg_value>"  # noqa: E731
    return f"{r.lit(name)} {_pairs(r, t, pair, _key_ok('<'), GLM_VALUES)}"


def _minimax_call(r: Rules, t: Tool) -> str:
    bad = '<>"\n'
    name = _name(t, lambda n: _plain_name(n) and not any(c in n for c in bad), "minimax_m2")
    args = _pairs(r, t, lambda k: f'<parameter name="{k}">', _key_ok(bad), MINIMAX_VALUES)
    return (
        f"{r.lit(f'<invoke name={chr(34)}{name}{chr(34)}>' + chr(10))} {args} {r.lit('</invoke>')}"
    )


DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _deepseek_call(r: Rules, t: Tool) -> str:
    """V3.1 (``NAME<sep>{..}``) or V3 (``function<sep>NAME`` and a fenced block): the parser
    reads both, and the checkpoint's template decides which the model writes."""
    name = _name(t, _plain_name, "deepseek_v3")
    args = _json_args(r, t)
    v31 = f"{r.lit(name + DS_SEP)} {args}"
    v3 = f"{r.lit(f'function{DS_SEP}{name}' + chr(10) + '```json' + chr(10))} {args} {q(chr(10) + '```')}"
    return f"{r.lit(DS_CALL)} ({v31} | {v3}) {r.lit(DS_CALL_END)}"


def _kimi_call(r: Rules, t: Tool) -> str:
    name = _name(t, lambda n: _plain_name(n) and ":" not in n, "kimi_k2")
    idx = r.rule("/0|[1-9][0-9]?/", ("kimi index",), terminal=True)
    head = r.lit(f"<|tool_call_begin|>functions.{name}:")
    args = f"{r.lit('<|tool_call_argument_begin|>')} {_json_args(r, t)}"
    return f"{head} {idx} {args} {r.lit('<|tool_call_end|>')}"


def _harmony_call(r: Rules, t: Tool) -> str:
    """A message to ``functions.NAME``; its ``<|call|>`` is an end of turn the engine adds."""
    ok = lambda n: bool(n) and all(c.isascii() and (c.isalnum() or c in "_.-:/@") for c in n)  # noqa: E731
    name = _name(t, ok, "harmony")
    head = r.lit(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>")
    return f"{head} {_json_args(r, t)}"


def _harmony_lead(r: Rules) -> str:
    """gpt-oss may reason in its analysis channel first (free text), as it always does."""
    text = r.until(f"/(?s:.*)/ & {without('<|')}", "<|end|>", key=("analysis",))
    return f"({r.lit('<|channel|>analysis<|message|>')} {text} {r.lit('<|start|>assistant')})?"


def _gemma_call(r: Rules, t: Tool) -> str:
    name = _name(t, lambda n: _plain_name(n) and ":" not in n, "gemma4")
    schema = _args(t)
    check(schema, t.name)
    return f"{r.lit('call:' + name)} {GEMMA.obj(r, schema, resolve(schema, schema), t.name)}"


def _python_call(r: Rules, t: Tool) -> str:
    name = _name(t, lambda n: all(IDENT.match(p) for p in n.split(".")), "pythonic")
    schema = _args(t)
    body = resolve(schema, schema)
    check(body, t.name)
    props, free = object_parts(body if isinstance(body, dict) else {})
    items = []
    for k, s, req in props:
        if not IDENT.match(k):
            raise ValueError(f"{t.name}: the parameter name {k!r} is not a Python identifier")
        items.append((f"{q(k + '=')} {PYTHON.value(r, schema, s, t.name)}", req))
    free_g = None
    if free is not None:
        key = r.rule("/[A-Za-z_][A-Za-z0-9_]*/", ("free key",), terminal=True)
        free_g = f'{key} "=" {PYTHON.value(r, schema, free, t.name)}'
    return f'{q(name + "(")} {listing(r, items, q(", "), free=free_g)} ")"'


#: writer name (``tool_families.Calls.writer``) -> how it writes one call.
WRITERS: dict[str, Writer] = {
    "json_arguments": Writer(_json_call("arguments")),
    "json_parameters": Writer(_json_call("parameters")),
    "qwen3_coder": Writer(_qwen3_call),
    "glm45": Writer(_glm_call),
    "minimax_m2": Writer(_minimax_call),
    "deepseek_v3": Writer(_deepseek_call),
    "kimi_k2": Writer(_kimi_call),
    "harmony": Writer(_harmony_call, lead=_harmony_lead),
    "gemma4": Writer(_gemma_call),
    "pythonic": Writer(_python_call),
}


def _syntax(calls: tool_families.Calls) -> Syntax:
    w = WRITERS[calls.writer]
    return Syntax(
        calls.open, calls.head, calls.sep, calls.tail, w.call, markers=calls.markers, lead=w.lead
    )


#: family -> how it writes calls (every family of the table).
SYNTAXES: dict[str, Syntax] = {f.name: _syntax(f.calls) for f in tool_families.FAMILIES}


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
    styled: Callable[[Any], str],
) -> str | None:
    """The grammar of one (``parallel``: one or more) call of ``tools`` in ``family``'s
    syntax, from the first token; None for a family without an entry."""
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
    styled: Callable[[Any], str],
) -> str | None:
    """``auto`` with strict tools: free text, or text and then calls once the opening tag
    is written (None: the family has no opening tag). Special tokens other than the
    family's tags and the end of turn stay free in the text (reasoning tags, channels)."""
    syn = SYNTAXES.get(family or "")
    if syn is None or syn.open is None or not tools:
        return None
    r = Rules(specials, (*syn.markers, syn.open), styled)
    body = _calls(syn, r, tools, parallel)
    free_ids = set(specials.values()) - set(eos) - set(r.tokens.values())
    sp = r.rule(f"<[{token_ranges(free_ids)}]>") if free_ids else None
    if r.is_token(syn.open):
        text = r.rule("/(?s:.*)/", terminal=True)
        free = f"{text}? ({sp} {text}?)*" if sp else f"{text}?"
        return f"start: {free} | {free} {r.lit(syn.open)} {body}\n{r.text()}"
    # A text opening tag: the text before it is lazy, so that it stops at the tag.
    text = r.rule(f"/(?s:.*)/ & {without(syn.open)}", terminal=True)
    free = f"{text}? ({sp} {text}?)*" if sp else f"{text}?"
    before = f"({text}? {sp})* " if sp else ""
    opened = f"opened[suffix={q(syn.open)}]: /(?s:.*)/"
    return f"start: {free} | {before}opened {body}\n{opened}\n{r.text()}"
