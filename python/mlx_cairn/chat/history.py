"""Render earlier turns of a conversation as they were generated, so the next turn hits the cache.

Many reasoning templates rewrite history once a new user message arrives:
Qwen3's drops the ``<think>`` block of every assistant message before the
last user message, even the empty one it prefilled when reasoning was off;
GLM-4.7 and DeepSeek do the same. Within a turn (an answer, its tool calls,
their results, the next answer) the prompt only grows, so a tool loop reads
each step from the prefix cache. The first request of the next turn rewrites
the whole previous turn, and the cache misses from the previous turn's first
assistant message on: its tool calls, their results (often most of the
prompt) and its answer are prefilled again. This is what a resumed Claude
Code session (``claude --continue``) ran into.

:func:`render_as_generated` keeps each completed turn as the template
rendered it while that turn was the last one (that is, as its requests were
prompted and its answers generated), and everything else as the template
renders it now::

    template now:   [prefix][u1 · turn 1 rewritten][u2 · turn 2 rewritten][u3 ...gen]
    as generated:   [prefix][u1 · turn 1 as last  ][u2 · turn 2 as last  ][u3 ...gen]
                        ▲ F   ▲ K1 (turn 1 alone)    ▲ K2 (turn 2 alone)   ▲ F

A turn runs from a user message to the next one. Its text is cut from a
render of that turn alone (K), between two anchors: the start of its user
message's content and the start of its last message's content. The rest
(the system prompt and tools, each last message's remainder, the next user
message's header, the open last turn and the generation prompt) comes from
the template's render of the whole conversation (F). Anchors are private-use
characters put at the start of a content string; a turn is spliced only when
the anchors leave both renders unchanged and in order, each message of the
turn stays in its text, and its last message renders the same way in both. So
a template that does not rewrite history gives back exactly its own text, and
one whose rendering cannot be cut this way keeps its own text for that turn.

The cost is one more render of the conversation and two renders of each
completed turn alone: linear in the conversation's length.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace

from mlx_cairn.chat.template import contains_in_order
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.types import Message

#: Renders messages (marked, with the request's tools and kwargs); the flag is
#: ``add_generation_prompt``.
Render = Callable[[list[Message], bool], str]

#: Private-use characters of plane 15 (DataMarks uses plane 16, the hybrid
#: snapshot probe U+FFFFD), removed again before tokenizing: one before a
#: turn's user message, one before its last message.
_AT_USER, _AT_LAST = "\U000ffffc", "\U000ffffb"
_ANCHORS = (_AT_USER, _AT_LAST)


def render_as_generated(
    messages: list[Message],
    render: Render,
    full: str,
    restore: Callable[[str], str] = str,
) -> str:
    """``full`` (the template's render of ``messages`` with the generation
    prompt) with every completed turn as it was generated (module docstring).

    ``restore`` maps a render back to the request's text (``DataMarks.restore``
    when ``render`` marks it).

    Example: with Qwen3's template and ``[user, assistant(reasoning, call),
    tool, assistant(reasoning, text), user]``, ``full`` has both assistant
    messages without their ``<think>`` blocks; the result has them as the
    model wrote them, so it starts with the previous request's prompt and
    answer.
    """
    turns = _turns(messages)
    if not turns or any(a in full for a in _ANCHORS):
        return full
    probe = list(messages)
    for q, last, _ in turns:
        probe[q] = _anchored(probe[q], _AT_USER)
        probe[last] = _anchored(probe[last], _AT_LAST)
    try:
        anchored = render(probe, True)
    except InvalidRequest:
        return full
    cuts = [i for i, ch in enumerate(anchored) if ch in _ANCHORS]
    # In message order, and nothing else changed: else a template that trims
    # or moves content keeps its own text.
    if "".join(anchored[i] for i in cuts) != "".join(_ANCHORS) * len(turns):
        return full
    if _without_anchors(anchored) != full:
        return full
    out: list[str] = []
    pos = 0
    for k, (q, _, end) in enumerate(turns):
        kept = _turn_as_last(messages[q:end], render, restore)
        start, stop = cuts[2 * k], cuts[2 * k + 1]
        if kept is None:
            continue
        between, remainder = kept
        # The last message must render the same way as the turn's last and in
        # the whole conversation, so the whole render's text can carry on from it.
        if not anchored.startswith(remainder, stop + 1):
            continue
        out += [anchored[pos : start + 1], between]
        pos = stop
    out.append(anchored[pos:])
    return _without_anchors("".join(out))


def _turns(messages: list[Message]) -> list[tuple[int, int, int]]:
    """(user index, index of the turn's last message, end) of each completed
    turn that has an assistant message and anchorable content."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    out = []
    for q, end in itertools.pairwise(users):
        last = end - 1
        if not any(m.role == "assistant" for m in messages[q + 1 : end]):
            continue
        # An empty content would gain text from the anchor (templates test it).
        if messages[q].content and messages[last].content:
            out.append((q, last, end))
    return out


def _anchored(m: Message, anchor: str) -> Message:
    return replace(m, content=anchor + m.content)


def _without_anchors(text: str) -> str:
    return text.replace(_AT_USER, "").replace(_AT_LAST, "")


def _turn_as_last(
    turn: list[Message], render: Render, restore: Callable[[str], str]
) -> tuple[str, str] | None:
    """The text of ``turn`` rendered on its own as the conversation's last turn:
    (from its user message's content to its last message's content, from
    there to the end), or None when the anchors change the render."""
    probe = list(turn)
    probe[0], probe[-1] = _anchored(turn[0], _AT_USER), _anchored(turn[-1], _AT_LAST)
    try:
        anchored = render(probe, False)
        plain = render(turn, False)
    except InvalidRequest:
        return None
    first, second = anchored.find(_AT_USER), anchored.find(_AT_LAST)
    if not 0 <= first < second or anchored.count(_AT_USER) + anchored.count(_AT_LAST) != 2:
        return None
    if _without_anchors(anchored) != plain:
        return None
    between = anchored[first + 1 : second]
    # Each message must stay in the turn's text: a template that moves a turn's
    # system message to the top when the turn stands alone does not.
    if not contains_in_order(restore(between), [m.content.strip() for m in turn[:-1]]):
        return None
    return between, anchored[second + 1 :]
