"""Earlier turns rendered as they were generated (chat/history.py), against the real templates.

The property the prefix cache needs: the prompt of a turn's last request plus
the answer the model generated to it is a prefix of every later prompt of the
conversation. Templates that rewrite history (Qwen3, Qwen3.5, GLM, MiniMax,
Gemma 4 drop earlier turns' reasoning) break it at the first user message
after the turn; ``history_as_generated`` restores it. Templates that do not
rewrite history render exactly as before.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mlx_cairn.chat.history import render_as_generated
from mlx_cairn.types import ChatRequest, Message, ToolCall
from scripted_model import scripted_model
from test_real_templates import CALL_ID, CASES, TOOLS, template

#: Templates that drop earlier turns' reasoning (or the empty block they
#: prefill) and for which the splice restores each turn as generated.
REWRITING = {
    "GLM-4.6",
    "GLM-4.7-Flash",
    "MiniMax-M2",
    "Qwen3.5-4B",
    "Qwen-Qwen3-0.6B",
    "google-gemma-4-31B-it",
}
#: Where the turn's answer is not a prefix of the next prompts with or without
#: the splice (a rendering the splice cannot cut out of the template).
UNREACHABLE = {
    # Analysis channels are dropped from every turn followed by a final message.
    "openai-gpt-oss-120b": "harmony drops analysis of earlier turns",
    "mistralai-Mistral-Nemo-Instruct-2407": "tools and system are moved to the last user turn",
    "Mistral-Small-3.2-24B-Instruct-2506": "tools are moved to the last user turn",
    "microsoft-Phi-3.5-mini-instruct": "tool turns are rendered differently once followed",
}


def conversation(*, system: bool, reasoning: bool, inner_system: bool) -> list[Message]:
    """Two finished turns (the first a tool loop) and a new user message; with
    ``inner_system`` system turns after user messages, as Claude Code sends."""

    def r(text: str) -> str | None:
        return text if reasoning else None

    def inner(text: str) -> list[Message]:
        return [Message("system", text)] if inner_system else []

    call = ToolCall(CALL_ID, "get_weather", json.dumps({"city": "Paris"}))
    head = [Message("system", "You are a helpful assistant.")] if system else []
    return [
        *head,
        Message("user", "Weather in Paris?"),
        *inner("Environment: linux."),
        Message("assistant", "", reasoning=r("Need the weather."), tool_calls=[call]),
        Message("tool", "sunny, 21 C", tool_call_id=CALL_ID, name="get_weather"),
        Message("assistant", "It is sunny.", reasoning=r("Read the result.")),
        Message("user", "And tomorrow?"),
        *inner("A reminder."),
        Message("assistant", "Sunny too.", reasoning=r("A guess.")),
        Message("user", "Thanks!"),
        *inner("Another reminder."),
    ]


def turn_ends(messages: list[Message]) -> list[int]:
    """Indexes of the assistant messages that end a turn (a user message follows)."""
    out = []
    for j, m in enumerate(messages):
        after = [x for x in messages[j + 1 :] if x.role != "system"]
        if m.role == "assistant" and after and after[0].role == "user":
            out.append(j)
    return out


@pytest.mark.parametrize("inner_system", [False, True], ids=["plain", "system-turns"])
@pytest.mark.parametrize("reasoning", [True, False], ids=["reasoning", "no-reasoning"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_turn_as_generated_is_a_prefix_of_the_next_prompts(
    name: str, reasoning: bool, inner_system: bool
) -> None:
    t = template(name)

    def render(msgs: list[Message], generation_prompt: bool) -> str:
        return t.render_marked(msgs, TOOLS, None, add_generation_prompt=generation_prompt)

    def as_generated(msgs: list[Message]) -> str:
        return render_as_generated(msgs, render, render(msgs, True))

    messages = conversation(
        system=CASES[name].system, reasoning=reasoning, inner_system=inner_system
    )
    full, spliced = render(messages, True), as_generated(messages)
    kept = []  # per turn end: (the template's own text keeps it, the splice does)
    for j in turn_ends(messages):
        prompt, answered = render(messages[:j], True), render(messages[: j + 1], False)
        if not answered.startswith(prompt):
            continue  # the template does not render a final answer as generated
        answer = answered[len(prompt) :]
        kept.append(
            (
                full.startswith(prompt + answer),
                spliced.startswith(as_generated(messages[:j]) + answer),
            )
        )
    if all(own for own, _ in kept):
        assert spliced == full  # nothing rewritten: the template's own text
    elif name in UNREACHABLE:
        assert [own for own, _ in kept] == [s for _, s in kept]  # no worse
    else:
        assert all(s for _, s in kept), kept
        assert name in REWRITING


def test_qwen3_prompt_keeps_earlier_reasoning_only_when_asked() -> None:
    """Through build_prompt: the flag keeps each turn as generated; without it
    Qwen3's template drops earlier turns' reasoning."""
    lm = scripted_model()
    messages = conversation(system=True, reasoning=True, inner_system=True)
    req = ChatRequest(messages=messages, history_as_generated=True)
    own = lm.prompt(replace(req, history_as_generated=False)).text
    kept = lm.prompt(req).text
    assert "Need the weather." not in own and "A guess." not in own
    # The last request of the previous turn, then the answer as the model wrote it.
    last = turn_ends(messages)[-1]
    previous = lm.prompt(replace(req, messages=messages[:last])).text
    assert kept.startswith(previous + "<think>\nA guess.\n</think>\n\nSunny too.<|im_end|>")
    assert kept.index("Need the weather.") < kept.index("Read the result.")


def test_text_that_holds_the_anchor_character_is_rendered_as_is() -> None:
    lm = scripted_model()
    messages = conversation(system=True, reasoning=True, inner_system=False)
    messages[1] = replace(messages[1], content="odd \U000ffffc text")
    req = ChatRequest(messages=messages, history_as_generated=True)
    assert lm.prompt(req).text == lm.prompt(replace(req, history_as_generated=False)).text


@pytest.mark.parametrize("name", sorted(name for name, case in CASES.items() if case.system))
def test_a_new_system_turn_leaves_the_prompt_before_it_alone(name: str) -> None:
    """A resumed Claude Code session sends a system turn after its new user
    message: the prompt up to that message must not change (DeepSeek's
    templates join every system turn into the system prompt on top; such a
    turn is rendered in place as user text instead)."""
    t = template(name)
    before = conversation(system=True, reasoning=False, inner_system=True)[:-1]
    after = [*before, Message("system", "The deferred tools are no longer available.")]
    old, new = (t.render(m, TOOLS) for m in (before, after))
    assert new.startswith(old[: old.rindex("Thanks!")])
