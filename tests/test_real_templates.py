"""The tool-call and reasoning formats checked against the models' real chat templates.

``tests/fixtures/templates/`` holds the templates that ship with the models
(see its README.md for where each comes from). For each:

- detection: the parser family and reasoning settings read from it;
- rendering: a conversation with tools, an assistant tool call, its result
  and a follow-up renders through our Jinja2 engine (HF semantics);
- round trip: what the template writes for an assistant tool-call turn is
  the model's own format, so our parser for the detected family reads it
  back into the same call (name and arguments) under any chunking, with
  any reasoning the template wrote split off as reasoning.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from _text_helpers import chunked, chunks_of
from mlx_cairn.chat import ChatTemplate, Tokenizer, detect_reasoning
from mlx_cairn.chat.detect import ReasoningInfo, starts_in_reasoning
from mlx_cairn.models.loaded import assemble
from mlx_cairn.text import Segment, TextPipeline, coalesce, parse_output, tool_schemas
from mlx_cairn.types import Message, Tool, ToolCall

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"


@dataclass(frozen=True)
class Case:
    """What a real template is expected to give."""

    #: The family the engine uses: detected, or Hermes for templates that do
    #: not render tools themselves (ChatTemplate spells them in that format).
    family: str | None
    #: (kwarg, default_on) when the model reasons, else None.
    reasoning: tuple[str | None, bool] | None = None
    #: Why the rendered call cannot be read back, when it cannot.
    lossy: str | None = None
    #: The template renders rich argument values (nested objects, quotes,
    #: newlines) exactly.
    rich: bool = True
    #: The template accepts a system turn.
    system: bool = True
    #: The template writes the reasoning of the turn it renders last.
    keeps_reasoning: bool = True
    #: The template prints every value as a string.
    strings_only: bool = False
    #: The format reads calls after text (pythonic calls must open the reply,
    #: as in vLLM's parser).
    text_then_calls: bool = True


CASES: dict[str, Case] = {
    "openai-gpt-oss-120b": Case("harmony", (None, True)),
    "GLM-4.6": Case("glm45", ("enable_thinking", True)),
    "GLM-4.7-Flash": Case("glm45", ("enable_thinking", True)),
    # V3.1 renders calls but not the tools list (users describe tools in the
    # system prompt): tools and calls are spelled the Hermes way.
    "deepseek-ai-DeepSeek-V3.1": Case("hermes", ("thinking", False)),
    # Renders DeepSeek calls but not the tools list: tools and calls are
    # spelled the Hermes way.
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": Case("hermes", (None, True)),
    "vllm-deepseekv3": Case("deepseek_v3"),
    # V3.2 writes calls in its own DSML markup, which no parser reads yet.
    "deepseek-ai-DeepSeek-V3.2": Case(
        None, ("enable_thinking", False), lossy="DSML calls have no parser"
    ),
    "moonshotai-Kimi-K2": Case("kimi_k2"),
    "moonshotai-Kimi-K2-Thinking": Case("kimi_k2", (None, True)),
    "MiniMax-M2": Case("minimax_m2", (None, True)),
    "Qwen3-Coder": Case("qwen3_coder"),
    "Qwen3.5-4B": Case("qwen3_coder", ("enable_thinking", True)),
    "Qwen-Qwen3-0.6B": Case("hermes", ("enable_thinking", True)),
    "Qwen-QwQ-32B": Case("hermes", (None, True)),
    "Qwen-Qwen2.5-7B-Instruct": Case("hermes"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": Case("hermes"),
    "ibm-granite-granite-4.0": Case("hermes"),
    "meta-llama-Llama-3.1-8B-Instruct": Case("llama3"),
    "meta-llama-Llama-3.2-3B-Instruct": Case("llama3"),
    "meta-llama-Llama-3.3-70B-Instruct": Case("llama3"),
    # vLLM's pythonic templates print values with "%s": strings come out
    # quoted (Llama 4) or bare (Llama 3.2), numbers as strings.
    "vllm-llama4_pythonic": Case("pythonic", rich=False, strings_only=True, text_then_calls=False),
    "vllm-llama3.2_pythonic": Case("pythonic", lossy="string values are printed unquoted"),
    "mistralai-Mistral-Nemo-Instruct-2407": Case("mistral"),
    "Mistral-Small-3.2-24B-Instruct-2506": Case("mistral"),
    "unsloth-mistral-Devstral-Small-2507": Case("mistral"),
    # Reasoning is rendered only from `thinking` content blocks.
    "mistralai-Ministral-3-14B-Reasoning-2512": Case(
        "mistral", (None, True), keeps_reasoning=False
    ),
    "google-gemma-4-31B-it": Case("gemma4", ("enable_thinking", False)),
    # No tool format of their own: tools are spelled the Hermes way.
    # Refuses system turns (a request's own system prompt stays refused; the
    # tool fallback's joins the first user turn).
    "google-gemma-2-2b-it": Case("hermes", system=False),
    "microsoft-Phi-3.5-mini-instruct": Case("hermes"),
    "HuggingFaceTB-SmolLM3-3B": Case("hermes", ("enable_thinking", True), keeps_reasoning=False),
    # Granite 3.3 calls with `<|tool_call|>[..]`, which no parser reads yet.
    "ibm-granite-granite-3.3-2B-Instruct": Case(
        None, ("thinking", False), lossy="<|tool_call|> calls have no parser"
    ),
}

#: What the engine stops generation at (the models' end-of-turn / EOS tokens):
#: the model's output for a turn is the text before the first of these.
STOPS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|eot|>",
    "<|eom|>",
    "</s>",
    "<｜end▁of▁sentence｜>",
    "<|user|>",
    "<|observation|>",
    "[e~[",
    "<turn|>",
    "<|tool_response>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<|end|>",
)
#: gpt-oss ends messages with <|end|> but stops only at these.
HARMONY_STOPS = ("<|call|>", "<|return|>")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "opts": {"type": "object"},
    },
    "required": ["city"],
}
TOOLS = [Tool("get_weather", "Get the weather for a city.", SCHEMA)]
SIMPLE: dict[str, object] = {"city": "Paris", "days": 3}
STRINGS: dict[str, object] = {"city": "Paris", "unit": "celsius"}
RICH: dict[str, object] = {
    "city": 'São Paulo, "SP"\nBrazil',
    "days": 3,
    "opts": {"unit": "C", "alerts": [1, 2]},
}
REASONING = "Need the weather."
USER = "Weather in Paris?"
CALL_ID = "toolu_01AbCdEfGhIjKlMn"


def source(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def template(name: str) -> ChatTemplate:
    return ChatTemplate(source(name), bos_token="<s>", eos_token="</s>")


@functools.cache
def engine_family(name: str) -> str | None:
    """The family the engine uses for this template, as the model loader sets it."""
    lm = assemble(
        name=name,
        model=None,  # type: ignore[arg-type]  # the loader never looks at it
        # A vocabulary without <think>, <tool_call> or [TOOL_CALLS]: the
        # template alone decides.
        tokenizer=Tokenizer(HFTokenizer(models.BPE())),
        template_source=source(name),
        eos_token_ids=set(),
        context_length=4096,
        identity=name,
    )
    return lm.parser_family


def head(name: str) -> list[Message]:
    system = [Message("system", "You are a helpful assistant.")] if CASES[name].system else []
    return [*system, Message("user", USER)]


def call_turn(args: dict[str, object], content: str = "", reasoning: str | None = None) -> Message:
    call = ToolCall(CALL_ID, "get_weather", json.dumps(args, ensure_ascii=False))
    return Message("assistant", content, reasoning=reasoning, tool_calls=[call])


def test_every_template_has_a_case() -> None:
    names = {p.stem for p in TEMPLATES.glob("*.jinja")}
    assert names == set(CASES)


@pytest.mark.parametrize("name", CASES)
def test_detection(name: str) -> None:
    case = CASES[name]
    assert engine_family(name) == case.family
    info = detect_reasoning(source(name))
    if case.reasoning is None:
        assert not info.supported
    else:
        assert info.supported
        assert (info.kwarg, info.default_on) == case.reasoning


@pytest.mark.parametrize("name", CASES)
def test_conversation_with_tools_renders(name: str) -> None:
    msgs = [
        *head(name),
        call_turn(SIMPLE, reasoning=REASONING),
        Message("tool", "Sunny, 20C", tool_call_id=CALL_ID, name="get_weather"),
        Message("assistant", "It is sunny in Paris."),
        Message("user", "Thanks! And tomorrow?"),
    ]
    text = template(name).render(msgs, tools=TOOLS)
    pos = 0
    for part in (USER, "get_weather", "Sunny, 20C", "It is sunny in Paris.", "And tomorrow?"):
        pos = text.find(part, pos)
        assert pos >= 0, (name, part)
    # The tool schema reached the prompt.
    assert "Get the weather for a city." in text


def model_output(name: str, turn: Message, **kwargs: object) -> tuple[str, bool]:
    """(what the model writes for ``turn``, whether its output starts inside
    reasoning), read off the template.

    The generation prompt is the template's prompt for the turn; what the
    same template writes for the turn in the history, after that prompt, is
    the model's output up to its end-of-turn token. Templates that open a
    reasoning block in the prompt but drop reasoning from the history get
    the reasoning the model would write there.
    """
    tpl = template(name)
    info = detect_reasoning(tpl.source)
    prompt = tpl.render(head(name), tools=TOOLS, add_generation_prompt=True, **kwargs)
    full = tpl.render([*head(name), turn], tools=TOOLS, add_generation_prompt=False, **kwargs)
    gen = prompt[prompt.rindex(USER) + len(USER) :]
    written = full[full.rindex(USER) + len(USER) :]
    in_reasoning = starts_in_reasoning(prompt, info)
    if written.startswith(gen):
        out = written[len(gen) :]
    elif written.startswith(gen.rstrip()):
        # Layout whitespace that differs between the prompt and the history.
        out = written[len(gen.rstrip()) :]
    else:
        assert in_reasoning, (name, gen, written)
        lead = gen[: gen.rindex(info.open_tag)]
        assert written.startswith(lead), (name, gen, written)
        out = f"{turn.reasoning or ''}\n{info.close_tag}\n\n{written[len(lead) :]}"
    stops = HARMONY_STOPS if engine_family(name) == "harmony" else STOPS
    end = min((i for s in stops if (i := out.find(s)) >= 0), default=len(out))
    return out[:end], in_reasoning


def parse(name: str, chunks: list[str], in_reasoning: bool) -> list[Segment]:
    """The engine's text pipeline over ``chunks`` for this template."""
    family = engine_family(name)
    info = detect_reasoning(source(name))
    pipe = TextPipeline(
        [],
        family=family,
        reasoning=info.supported,
        starts_in_reasoning=in_reasoning,
        tool_schemas=tool_schemas(family, TOOLS),
    )
    segs: list[Segment] = []
    for c in chunks:
        got, stop = pipe.push(c)
        assert stop is None
        segs += got
    return coalesce([*segs, *pipe.flush()])


def shape(segs: list[Segment]) -> list[tuple[str, object]]:
    """(kind, stripped text or (name, args)); whitespace-only reasoning (the
    empty ``<think>\n\n</think>`` of a turn without reasoning) left out."""
    return [
        (
            s.kind,
            (s.name, json.loads(s.arguments or "")) if s.kind == "tool_call" else s.text.strip(),
        )
        for s in segs
        if s.kind != "reasoning" or s.text.strip()
    ]


def thinking_kwargs(name: str) -> dict[str, object]:
    info = detect_reasoning(source(name))
    return {info.kwarg: True} if info.kwarg else {}


ROUND_TRIPS = [n for n, c in CASES.items() if c.lossy is None]


def expected(
    name: str, out: str, args: dict[str, object], content: str
) -> list[tuple[str, object]]:
    """The segments of ``out``: reasoning and text where the template wrote
    them (some drop a call turn's text, Gemma 4 writes it after the call)."""
    call = out.index("get_weather")
    parts: list[tuple[int, tuple[str, object]]] = [(call, ("tool_call", ("get_weather", args)))]
    if REASONING in out:
        parts.append((out.index(REASONING), ("reasoning", REASONING)))
    if content and content in out:
        # gpt-oss's template writes a tool-call turn's text as its analysis.
        kind = "reasoning" if engine_family(name) == "harmony" else "text"
        parts.append((out.index(content), (kind, content)))
    return [p for _, p in sorted(parts, key=lambda x: x[0])]


def simple_args(name: str) -> dict[str, object]:
    return STRINGS if CASES[name].strings_only else SIMPLE


@pytest.mark.parametrize("name", ROUND_TRIPS)
@pytest.mark.parametrize("variant", ["reasoning", "content", "rich"])
def test_rendered_call_parses_back(name: str, variant: str) -> None:
    case = CASES[name]
    if variant == "rich" and not case.rich:
        pytest.skip("the template prints values lossily")
    if variant == "content" and not case.text_then_calls:
        pytest.skip("the format has no text before calls")
    args = RICH if variant == "rich" else simple_args(name)
    content = "Let me check." if variant == "content" else ""
    turn = call_turn(args, content, REASONING if variant == "reasoning" else None)
    out, in_reasoning = model_output(name, turn, **thinking_kwargs(name))
    want = expected(name, out, args, content)
    if variant == "reasoning" and case.reasoning is not None and case.keeps_reasoning:
        assert REASONING in out, (name, out)
    got = shape(parse(name, [out], in_reasoning))
    assert got == want, (name, out)
    for n in (1, 2, 3, 7):
        assert shape(parse(name, chunks_of(out, n), in_reasoning)) == want, (name, n)


@given(name=st.sampled_from(ROUND_TRIPS), data=st.data())
def test_rendered_call_parses_back_in_any_chunking(name: str, data: st.DataObject) -> None:
    case = CASES[name]
    args = RICH if case.rich else simple_args(name)
    turn = call_turn(args, "Let me check." if case.text_then_calls else "", REASONING)
    out, in_reasoning = model_output(name, turn, **thinking_kwargs(name))
    one_shot = shape(parse(name, [out], in_reasoning))
    assert ("tool_call", ("get_weather", args)) in one_shot
    assert shape(parse(name, data.draw(chunked(out)), in_reasoning)) == one_shot


@pytest.mark.parametrize("name", [n for n in ROUND_TRIPS if CASES[n].reasoning])
def test_rendered_reasoning_is_reasoning(name: str) -> None:
    """An answer turn with reasoning: the reasoning the template writes comes
    back as reasoning, the answer as text."""
    turn = Message("assistant", "It is sunny.", reasoning=REASONING)
    out, in_reasoning = model_output(name, turn, **thinking_kwargs(name))
    got = shape(parse(name, [out], in_reasoning))
    want = [("text", "It is sunny.")]
    if REASONING in out:
        want.insert(0, ("reasoning", REASONING))
    assert got == want, (name, out)
    family = engine_family(name)
    one_shot = parse_output(out, family=family, reasoning=True, starts_in_reasoning=in_reasoning)
    assert shape(coalesce(one_shot)) == want


# ---- what the template module does for these templates --------------------


def test_mistral_call_ids_are_nine_alphanumerics() -> None:
    """Mistral templates refuse other ids; every id maps to a stable one,
    the same in the call and in its result."""
    msgs = [
        Message("user", USER),
        call_turn(SIMPLE),
        Message("tool", "Sunny", tool_call_id=CALL_ID),
    ]
    text = template("Mistral-Small-3.2-24B-Instruct-2506").render(msgs, tools=TOOLS)
    start = text.index("[CALL_ID]") + len("[CALL_ID]")
    new_id = text[start : text.index("[ARGS]", start)]
    assert len(new_id) == 9 and new_id.isalnum()
    assert text.count(new_id) == 2  # the call and its result
    assert new_id in template("Mistral-Small-3.2-24B-Instruct-2506").render(msgs, tools=TOOLS)


def test_kimi_call_ids_name_the_function() -> None:
    """Kimi K2 Thinking writes the id as the call's name: ids become the
    model's own ``functions.NAME:INDEX``, counted over the conversation."""
    msgs = [
        Message("user", USER),
        call_turn(SIMPLE),
        Message("tool", "Sunny", tool_call_id=CALL_ID),
        Message("assistant", "", tool_calls=[ToolCall("other", "get_weather", "{}")]),
        Message("tool", "Rain", tool_call_id="other"),
    ]
    text = template("moonshotai-Kimi-K2-Thinking").render(msgs, tools=TOOLS)
    assert "<|tool_call_begin|>functions.get_weather:0<" in text
    assert "<|tool_call_begin|>functions.get_weather:1<" in text
    assert "## Return of functions.get_weather:1" in text
    assert CALL_ID not in text


def test_string_arguments_concatenate_as_json() -> None:
    """DeepSeek's templates concatenate the arguments as a string."""
    text = template("deepseek-ai-DeepSeek-V3.1").render([Message("user", USER), call_turn(RICH)])
    assert json.dumps(RICH, ensure_ascii=False) in text


def test_reasoning_info_of_mistral_reasoning_models() -> None:
    info = detect_reasoning(source("mistralai-Ministral-3-14B-Reasoning-2512"))
    assert info == ReasoningInfo(True, None, True, "[THINK]", "[/THINK]")
    segs = parse_output(
        "[THINK]plan[/THINK]Hi", family="mistral", reasoning=True, starts_in_reasoning=False
    )
    assert shape(segs) == [("reasoning", "plan"), ("text", "Hi")]
