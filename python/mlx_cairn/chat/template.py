"""Chat templates rendered with Jinja2 the way Hugging Face ``apply_chat_template`` does.

Same environment (sandboxed, ``trim_blocks``, ``lstrip_blocks``, loop
controls), the same helpers (``raise_exception``, ``tojson``,
``strftime_now``, the ``{% generation %}`` tag) and the same variables
(``messages``, ``tools``, ``add_generation_prompt``, special-token strings,
extra kwargs such as ``enable_thinking``).

Example::

    tpl = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    text = tpl.render([Message("user", "Hi")], tools=None)
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlx_cairn.chat.data import DataMarks, unescape_markers
from mlx_cairn.errors import InvalidRequest, ModelLoadError
from mlx_cairn.types import IMAGE_MARK, Message, Tool


class TemplateRaise(Exception):
    """Raised by a template's ``raise_exception(...)``."""


def _raise_exception(message: str) -> None:
    raise TemplateRaise(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike Jinja's built-in, HF's tojson does not HTML-escape.
    text = json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    # Markers of request text (chat/data.py) must reach the tokenizer intact.
    return unescape_markers(text) if ensure_ascii else text


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012  (Jinja reads a class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def content_parts(content: str) -> list[dict[str, Any]]:
    """``content`` as Hugging Face content parts: an image part at each IMAGE_MARK."""
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(content.split(IMAGE_MARK)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def message_to_dict(m: Message) -> dict[str, Any]:
    """A :class:`Message` in the dict shape HF chat templates expect.

    Reasoning goes in ``reasoning_content`` (Qwen, GLM, DeepSeek, Kimi,
    MiniMax) and ``thinking`` (gpt-oss), except that a turn with both text
    and tool calls gets no ``thinking``: gpt-oss's template refuses both
    there (it writes the text as the analysis message itself).
    """
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.images and IMAGE_MARK in m.content:
        # Vision templates take content parts (Hugging Face processors' shape).
        d["content"] = content_parts(m.content)
    if m.reasoning:
        d["reasoning_content"] = m.reasoning
        if not (m.content and m.tool_calls):
            d["thinking"] = m.reasoning
    if m.tool_calls:
        calls = []
        for tc in m.tool_calls:
            try:
                args: Any = json.loads(tc.arguments) if tc.arguments else {}
            except json.JSONDecodeError:
                args = tc.arguments
            calls.append(
                {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": args}}
            )
        d["tool_calls"] = calls
    if m.role == "tool":
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
    return d


def tool_to_dict(t: Tool) -> dict[str, Any]:
    """A :class:`Tool` in the OpenAI function shape HF templates expect."""
    return {
        "type": "function",
        "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
    }


#: System-prompt text describing tools, for templates that do not render ``tools``
#: themselves (the Hermes format, which the "hermes" output parser reads).
TOOLS_FALLBACK_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _fallback_tools(
    msgs: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    tools_ok: bool,
    calls_ok: bool,
) -> list[dict[str, Any]]:
    """Spell tools, tool calls and tool results as text for templates that ignore them."""
    out = [dict(m) for m in msgs]
    if tools and not tools_ok:
        listing = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = TOOLS_FALLBACK_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
        else:
            out.insert(0, {"role": "system", "content": prompt})
    if calls_ok:
        return out
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            parts = [m.get("content") or ""]
            for c in calls:
                body = {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                parts.append(f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>")
            m["content"] = "\n".join(p for p in parts if p)
        if m["role"] == "tool":
            m["role"] = "user"
            content = m.get("content", "")
            if isinstance(content, list):  # content parts (a picture in the result)
                m["content"] = [
                    {"type": "text", "text": "<tool_response>\n"},
                    *content,
                    {"type": "text", "text": "\n</tool_response>"},
                ]
            else:
                m["content"] = f"<tool_response>\n{content}\n</tool_response>"
            m.pop("tool_call_id", None)
            m.pop("name", None)
    return out


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
    ) -> None:
        self.source = source
        self.special = {
            "bos_token": bos_token or "",
            "eos_token": eos_token or "",
            "pad_token": pad_token or "",
            "unk_token": unk_token or "",
        }
        self._id_style = _call_id_style(source)
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"chat template does not compile: {e} (line {e.lineno})") from None

    @property
    def handles_tools(self) -> bool:
        """The template renders a ``tools`` list itself."""
        return "tools" in self.source

    @property
    def handles_tool_calls(self) -> bool:
        """The template renders assistant ``tool_calls`` itself, in the syntax
        its tool instructions teach. A template that renders calls but not
        the tools list (DeepSeek-R1 distills) gets Hermes instructions from
        us, so its calls are spelled the Hermes way too."""
        return self.handles_tools and "tool_calls" in self.source

    @property
    def adds_bos(self) -> bool:
        """True when the template writes ``bos_token`` itself."""
        return "bos_token" in self.source

    def render(
        self,
        messages: list[Message] | list[dict[str, Any]],
        tools: list[Tool] | list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render a conversation; a template failure raises :class:`InvalidRequest`.

        Templates that do not know tools get them as text: a Hermes-style tool
        list in the system prompt, ``<tool_call>`` blocks in assistant turns,
        ``<tool_response>`` user turns for results.
        """
        return self.render_marked(
            messages, tools, None, add_generation_prompt=add_generation_prompt, kwargs=kwargs
        )

    def render_marked(
        self,
        messages: list[Message] | list[dict[str, Any]],
        tools: list[Tool] | list[dict[str, Any]] | None,
        marks: DataMarks | None,
        *,
        add_generation_prompt: bool = True,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """:meth:`render` with the request's strings marked by ``marks`` first.

        Every string the request supplies (messages, tools, template kwargs)
        is marked before the template and the tool fallbacks see it, so the
        result holds markers where request text held special-token text and
        the template's own markup everywhere else (``marks.restore`` gives
        the text :meth:`render` returns).
        """
        msgs = [message_to_dict(m) if isinstance(m, Message) else m for m in messages]
        tool_dicts = (
            [tool_to_dict(t) if isinstance(t, Tool) else t for t in tools] if tools else None
        )
        kwargs = dict(kwargs or {})
        if marks is not None:
            msgs, tool_dicts, kwargs = marks.mark(msgs), marks.mark(tool_dicts), marks.mark(kwargs)
        msgs = _template_call_ids(_json_arguments(msgs), self._id_style)
        had_system = bool(msgs) and msgs[0]["role"] == "system"
        if not (self.handles_tools and self.handles_tool_calls):
            msgs = _fallback_tools(
                msgs, tool_dicts, tools_ok=self.handles_tools, calls_ok=self.handles_tool_calls
            )
            if not self.handles_tools:
                tool_dicts = None
        variables = {
            **self.special,
            **kwargs,
            "tools": tool_dicts,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._render_turns(msgs, variables)
        except InvalidRequest:
            # Templates without a system role (Gemma 2) refuse the system turn
            # the tool fallback adds: its text joins the first user turn. (A
            # system turn of the request's own stays refused.)
            if had_system or not (msgs and msgs[0]["role"] == "system"):
                raise
            return self._render_turns(_leading_system_as_user(msgs), variables)

    def _render_turns(self, msgs: list[dict[str, Any]], variables: dict[str, Any]) -> str:
        inner = _inner_system_texts(msgs)
        if not inner:
            return self._render(msgs, variables)
        try:
            text = self._render(msgs, variables)
        except InvalidRequest:
            text = None
        # A template that refuses a system turn after the first message, drops
        # it or moves it (DeepSeek V3.1 joins every system turn into the
        # system prompt on top, so each new one changes the whole prompt) gets
        # it in place as a marked user turn instead.
        if text is None or not contains_in_order(text, _inner_system_places(msgs)):
            text = self._render(_system_turns_as_user(msgs), variables)
        return text

    def _render(self, msgs: list[dict[str, Any]], variables: dict[str, Any]) -> str:
        try:
            return self._template.render(messages=msgs, **variables)
        except TemplateRaise as e:
            raise InvalidRequest(f"chat template: {e}") from None
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"chat template failed: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise InvalidRequest(f"chat template failed: {type(e).__name__}: {e}") from None


class JsonArguments(dict[str, Any]):
    """Tool-call arguments as templates see them: a mapping (HF's convention),
    which reads as its JSON text wherever a template treats it as a string.

    DeepSeek's templates write ``'...' + tool['function']['arguments'] + '...'``
    (OpenAI's arguments are a JSON string), others iterate the mapping or
    apply ``tojson``; both work.

    >>> '<' + JsonArguments({"a": 1}) + '>'
    '<{"a": 1}>'
    """

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other: object) -> str:
        if isinstance(other, str):
            return str(self) + other
        return NotImplemented

    def __radd__(self, other: object) -> str:
        if isinstance(other, str):
            return other + str(self)
        return NotImplemented


def _json_arguments(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``msgs`` with every tool call's mapping arguments as :class:`JsonArguments`."""
    out = []
    for m in msgs:
        calls = m.get("tool_calls")
        if calls and any(isinstance(c.get("function", {}).get("arguments"), dict) for c in calls):
            m = {**m, "tool_calls": [_with_json_arguments(c) for c in calls]}
        out.append(m)
    return out


def _with_json_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), dict):
        return call
    return {**call, "function": {**fn, "arguments": JsonArguments(fn["arguments"])}}


def _call_id_style(source: str) -> str | None:
    """How the template needs tool-call ids spelled, or None for as given.

    - ``"mistral"``: nine alphanumerics (Mistral templates raise on others,
      and the model writes such ids after ``[CALL_ID]``).
    - ``"kimi"``: ``functions.NAME:INDEX``, the model's own call ids, for
      Kimi templates that render the id verbatim as the call's name.
    """
    if "alphanumeric strings with length 9" in source or "[CALL_ID]" in source:
        return "mistral"
    if "<|tool_call_begin|>" in source and "functions." not in source:
        return "kimi"
    return None


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_KIMI_ID = re.compile(r"functions\.[^:\s]+:\d+")
_ALNUM = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def _mistral_id(call_id: str) -> str:
    """A stable nine-character alphanumeric id for ``call_id``."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    out = []
    for _ in range(9):
        n, r = divmod(n, len(_ALNUM))
        out.append(_ALNUM[r])
    return "".join(out)


def _template_call_ids(msgs: list[dict[str, Any]], style: str | None) -> list[dict[str, Any]]:
    """Rewrite tool-call ids (and the tool results' ``tool_call_id``) into
    ``style`` (:func:`_call_id_style`). Each id depends only on the turns
    before it, so a conversation renders the same way as it grows."""
    if style is None:
        return msgs
    ids: dict[str, str] = {}
    out = []
    for m in msgs:
        calls = m.get("tool_calls")
        if calls:
            new_calls = []
            for c in calls:
                old = c.get("id")
                if isinstance(old, str):
                    if style == "mistral":
                        new = _mistral_id(old)
                    elif _KIMI_ID.fullmatch(old):
                        new = old
                    else:
                        new = f"functions.{c.get('function', {}).get('name', '')}:{len(ids)}"
                    ids.setdefault(old, new)
                    c = {**c, "id": ids[old]}
                new_calls.append(c)
            m = {**m, "tool_calls": new_calls}
        ref = m.get("tool_call_id")
        if m.get("role") == "tool" and isinstance(ref, str):
            new_ref = ids.get(ref, _mistral_id(ref) if style == "mistral" else ref)
            m = {**m, "tool_call_id": new_ref}
        out.append(m)
    return out


#: How a system turn inside the conversation reads when the template only
#: accepts a leading system prompt: a user turn (or part of one) marked as
#: a system instruction.
INNER_SYSTEM_FORMAT = "<system>\n{text}\n</system>"


def _leading_system_as_user(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leading system turn's text put before the first user turn's (or
    as a user turn of its own when none follows it)."""
    system, rest = msgs[0], msgs[1:]
    text = system.get("content") or ""
    if rest and rest[0]["role"] == "user" and isinstance(rest[0].get("content"), str):
        return [{**rest[0], "content": f"{text}\n\n{rest[0]['content']}"}, *rest[1:]]
    return [{"role": "user", "content": text}, *rest]


def _inner_system_texts(msgs: list[dict[str, Any]]) -> list[str]:
    """Contents of system turns that follow a non-system turn (stripped, as
    templates often strip them; empty ones left out)."""
    out: list[str] = []
    seen_other = False
    for m in msgs:
        if m["role"] != "system":
            seen_other = True
        elif seen_other and isinstance(m.get("content"), str) and m["content"].strip():
            out.append(m["content"].strip())
    return out


def _inner_system_places(msgs: list[dict[str, Any]]) -> list[str]:
    """Each inner system turn's text after the text of the turn before it (the
    nearest with text), stripped: in this order in a render that keeps system
    turns in place."""
    out: list[str] = []
    before: dict[str, Any] | None = None  # the last turn with text, not system
    placed: dict[str, Any] | None = None  # the last one put in ``out``
    seen_other = False
    for m in msgs:
        text = m.get("content")
        text = text.strip() if isinstance(text, str) else ""
        if m["role"] != "system":
            seen_other = True
            if text:
                before = m
        elif seen_other and text:
            if before is not None and before is not placed:
                out.append(before["content"].strip())
                placed = before
            out.append(text)
    return out


def contains_in_order(text: str, parts: list[str]) -> bool:
    """Whether each of ``parts`` stands in ``text``, in this order, without overlap."""
    pos = 0
    for part in parts:
        pos = text.find(part, pos)
        if pos < 0:
            return False
        pos += len(part)
    return True


def _system_turns_as_user(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rewrite system turns after the first non-system turn as marked user text.

    The marked text joins the user turn just before it, else the user turn
    just after it, else it stands as a user turn of its own, so templates
    that insist on alternating roles accept it. The rewrite depends only on
    the turns around it, so a conversation renders the same way as it grows
    (prefix reuse across turns holds).
    """
    out: list[dict[str, Any]] = []
    carry: list[str] = []  # marked texts waiting for the next user turn
    seen_other = False
    for i, m in enumerate(msgs):
        if m["role"] != "system" or not seen_other:
            seen_other = seen_other or m["role"] != "system"
            m = dict(m)
            if carry and m["role"] == "user" and isinstance(m.get("content"), str):
                m["content"] = "\n\n".join([*carry, m["content"]])
                carry = []
            elif carry:
                out.append({"role": "user", "content": "\n\n".join(carry)})
                carry = []
            out.append(m)
            continue
        marked = INNER_SYSTEM_FORMAT.format(text=m.get("content") or "")
        prev = out[-1] if out else None
        nxt = msgs[i + 1] if i + 1 < len(msgs) else None
        if prev is not None and prev["role"] == "user" and isinstance(prev.get("content"), str):
            prev["content"] = f"{prev['content']}\n\n{marked}"
        elif nxt is not None and nxt["role"] in ("user", "system"):
            carry.append(marked)
        else:
            out.append({"role": "user", "content": marked})
    if carry:
        out.append({"role": "user", "content": "\n\n".join(carry)})
    return out
