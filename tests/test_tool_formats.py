"""The newer tool-call formats: family detection from chat templates, and model output
parsed end to end through ``mlx_cairn.text`` (any chunking) and through the engine.

Each template below is a small stand-in holding the markers of the real one
(how it renders earlier tool calls or spells the call format for the model).
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _text_helpers import chunked, chunks_of, model_text
from mlx_cairn.chat import ChatTemplate, detect_parser_family, detect_reasoning
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import closing_at_rest
from mlx_cairn.text import (
    FAMILIES,
    OutputParser,
    Segment,
    TextPipeline,
    coalesce,
    keeps_special_tokens,
    output_family,
    parse_output,
    tool_schemas,
)
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams, Tool, ToolCall
from scripted_model import say, scripted_model

LOOP = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"

TEMPLATES = {
    # gpt-oss: every message in channels; tool calls to functions.NAME.
    "harmony": (
        "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
        "{% if tools %}<|start|>assistant<|channel|>commentary to=functions.x "
        "<|constrain|>json<|message|>{}<|call|>{% endif %}"
        "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
    ),
    # GLM-4.5 / 4.7 (they also hold <tool_call> and <think>).
    "glm45": (
        "[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
        "{% if tools %}<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
        "<arg_value>{arg-value-1}</arg_value>\n</tool_call>{% endif %}"
        "{% if add_generation_prompt %}<|assistant|><think>{% endif %}"
    ),
    "deepseek_v3": (
        "{{ bos_token }}{% for m in messages %}<｜{{ m.role }}｜>{{ m.content }}{% endfor %}"
        "{% if tools %}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>x<｜tool▁sep｜>{}"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>{% endif %}<｜Assistant｜>"
    ),
    "kimi_k2": (
        "{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}"
        "<|im_end|>{% endfor %}{% if tools %}<|tool_calls_section_begin|><|tool_call_begin|>"
        "functions.x:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>{% endif %}<|im_assistant|>assistant<|im_middle|>"
    ),
    "gemma4": (
        "{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}"
        '{% if tools %}<|tool_call>call:x{a:<|"|>b<|"|>}<tool_call|>{% endif %}'
        "{% if enable_thinking %}<|think|>{% endif %}<|turn>model\n"
    ),
    "minimax_m2": (
        "{% for m in messages %}]~b]{{ m.role }}\n{{ m.content }}[e~[\n{% endfor %}"
        '{% if tools %}<minimax:tool_call>\n<invoke name="x">\n</invoke>\n'
        "</minimax:tool_call>{% endif %}]~b]ai\n<think>\n"
    ),
    # Llama 3.2 / 4 pythonic templates tell the model the call syntax.
    "pythonic": (
        LOOP + "{% if tools %}you MUST put it in the format of [func_name1(params_name1="
        "params_value1, params_name2=params_value2...), func_name2(params)]{% endif %}"
    ),
}

#: Model output in each family's syntax: reasoning, a little text, then a
#: call to get_weather(city="Paris", days=3).
OUTPUTS = {
    "harmony": (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris", "days": 3}'
    ),
    "glm45": (
        "<think>Need the weather.</think>\nChecking.<tool_call>get_weather\n"
        "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    ),
    "deepseek_v3": (
        "<think>Need the weather.</think>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
        "function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    ),
    "kimi_k2": (
        "<think>Need the weather.</think>Checking.<|tool_calls_section_begin|>"
        "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>'
    ),
    "gemma4": (
        "<|channel>thought\nNeed the weather.<channel|>Checking."
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
    ),
    "minimax_m2": (
        "<think>Need the weather.</think>\n\nChecking.<minimax:tool_call>\n"
        '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>'
    ),
    "pythonic": '[get_weather(city="Paris", days=3)]',
}

NEW = list(TEMPLATES)
CALL = ("get_weather", {"city": "Paris", "days": 3})


def expected(family: str) -> list[tuple[str, object]]:
    """(kind, text or (name, args)) of OUTPUTS[family]."""
    if family == "pythonic":
        return [("tool_call", CALL)]
    head = [("reasoning", "Need the weather.")]
    if family != "harmony":
        head.append(("text", "Checking."))
    return [*head, ("tool_call", CALL)]


def shape(segs: list[Segment]) -> list[tuple[str, object]]:
    return [
        (s.kind, (s.name, json.loads(s.arguments or "")) if s.kind == "tool_call" else s.text)
        for s in segs
    ]


def run_pipeline(chunks: list[str], family: str, **kw: object) -> list[Segment]:
    pipe = TextPipeline([], family=family, reasoning=True, **kw)  # type: ignore[arg-type]
    segs: list[Segment] = []
    for c in chunks:
        out, stop = pipe.push(c)
        assert stop is None
        segs += out
    return coalesce([*segs, *pipe.flush()])


def test_every_new_family_is_known() -> None:
    assert set(NEW) <= set(FAMILIES)


@pytest.mark.parametrize("family", NEW)
def test_detected_from_its_template(family: str) -> None:
    src = TEMPLATES[family]
    assert detect_parser_family(src) == family
    # The stand-in is a real template: it renders, markers and all.
    tpl = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    tools = [Tool("get_weather", "", {"type": "object", "properties": {}})]
    rendered = tpl.render([Message("user", "hi")], tools=tools)
    assert "hi" in rendered
    assert detect_parser_family(rendered) == family


def test_reasoning_modes_of_channel_families() -> None:
    harmony = detect_reasoning(TEMPLATES["harmony"])
    assert harmony.supported and harmony.default_on and harmony.kwarg is None
    assert harmony.open_tag == "<|channel|>analysis<|message|>"
    gemma = detect_reasoning(TEMPLATES["gemma4"])
    assert gemma.supported and gemma.kwarg == "enable_thinking" and not gemma.default_on
    for family in ("glm45", "minimax_m2"):
        assert detect_reasoning(TEMPLATES[family]).supported


@pytest.mark.parametrize("family", NEW)
def test_output_parses_for_every_chunk_size(family: str) -> None:
    text = OUTPUTS[family]
    want = expected(family)
    assert shape(parse_output(text, family=family, reasoning=True)) == want
    for n in (1, 2, 3, 7):
        assert shape(run_pipeline(chunks_of(text, n), family)) == want, n


@given(family=st.sampled_from(NEW), data=st.data())
def test_output_parses_for_any_chunking(family: str, data: st.DataObject) -> None:
    text = OUTPUTS[family]
    segs = run_pipeline(data.draw(chunked(text)), family)
    assert shape(segs) == expected(family)
    for s in segs:
        for tag in ("<|", "|>", "<｜", "<think>", "</think>", "<tool_call>", "<arg_", "<invoke"):
            assert tag not in s.text, (family, s)


#: Pieces of every new family's syntax, for random inputs.
FRAGMENTS = sorted(
    {
        piece
        for out in OUTPUTS.values()
        for piece in re.split(r"(<[^<>]*>|\n|\{|\}|\[|\]|\(|\))", out)
        if piece
    }
    | {"<", "<|", "|>", "é", "🙂", " ", "<|end|>", "<|start|>", "<|call|>", "<|im_end|>"}
)


#: Random model text in a new family, with or without reasoning, and a chunking to draw.
random_texts = given(
    text=model_text(FRAGMENTS, max_size=24),
    family=st.sampled_from(NEW),
    reasoning=st.booleans(),
    data=st.data(),
)


@random_texts
def test_random_text_is_chunking_invariant(
    text: str, family: str, reasoning: bool, data: st.DataObject
) -> None:
    want = parse_output(text, family=family, reasoning=reasoning)
    pipe = TextPipeline([], family=family, reasoning=reasoning)
    segs: list[Segment] = []
    for c in data.draw(chunked(text)):
        segs += pipe.push(c)[0]
    assert coalesce([*segs, *pipe.flush()]) == want
    for s in want:
        if s.kind == "tool_call":
            assert s.name and isinstance(json.loads(s.arguments or ""), dict)
        else:
            assert s.text


def run_cut(chunks: list[str], family: str, reasoning: bool = True) -> list[Segment]:
    """Like run_pipeline, but generation was cut by max_tokens: flush(cut=True)."""
    pipe = TextPipeline([], family=family, reasoning=reasoning)
    segs: list[Segment] = []
    for c in chunks:
        segs += pipe.push(c)[0]
    return coalesce([*segs, *pipe.flush(cut=True)])


@pytest.mark.parametrize("family", NEW)
def test_a_call_cut_by_max_tokens_is_dropped(family: str) -> None:
    text = OUTPUTS[family]
    # Cut inside the arguments: every family's call spells "Paris".
    cut = text[: text.index("Paris") + 2]
    before_call = expected(family)[:-1]
    for n in (1, 2, 3, 7, len(cut)):
        segs = run_cut(chunks_of(cut, n), family)
        assert shape(segs) == before_call, n
    # The stream ended there instead: the open call is parsed or comes back as text.
    assert shape(run_pipeline([cut], family)) != before_call
    # A closed call stays under a cut (harmony's closes at <|call|>, which the
    # engine never hands over: it ends generation, and then flush() runs).
    closed = text + "<|call|>" if family == "harmony" else text
    assert shape(run_cut([closed], family)) == expected(family)


@random_texts
def test_random_text_cut_is_chunking_invariant(
    text: str, family: str, reasoning: bool, data: st.DataObject
) -> None:
    one = OutputParser(family, reasoning)
    want = coalesce([*one.push(text), *one.flush(cut=True)])
    assert run_cut(data.draw(chunked(text)), family, reasoning) == want


@pytest.mark.parametrize(
    "schemas",
    [
        {"f": {"type": "object", "properties": {"zip": {"type": "string"}}}},
        json.dumps({"f": {"properties": {"zip": {"type": "string"}}}}),
        [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"properties": {"zip": {"type": "string"}}},
                },
            }
        ],
    ],
)
def test_schemas_keep_string_values_strings(schemas: object) -> None:
    glm = "<tool_call>f<arg_key>zip</arg_key><arg_value>01234</arg_value><arg_key>n</arg_key><arg_value>7</arg_value></tool_call>"
    mm = '<minimax:tool_call><invoke name="f"><parameter name="zip">01234</parameter><parameter name="n">7</parameter></invoke></minimax:tool_call>'
    for family, text in (("glm45", glm), ("minimax_m2", mm)):
        segs = parse_output(text, family=family, tool_schemas=schemas)  # type: ignore[arg-type]
        assert json.loads(segs[0].arguments or "") == {"zip": "01234", "n": 7}
        # Without schemas "01234" is not JSON either, so it stays a string too,
        # while a JSON-looking value becomes JSON.
        segs = parse_output(text.replace("01234", "12"), family=family)
        assert json.loads(segs[0].arguments or "") == {"zip": 12, "n": 7}


def test_bad_schemas_are_value_errors() -> None:
    with pytest.raises(ValueError, match="tool schemas"):
        TextPipeline([], family="glm45", tool_schemas="{")
    with pytest.raises(ValueError, match="tool schemas"):
        parse_output("x", family="glm45", tool_schemas=[{"parameters": {}}])


def test_family_policies() -> None:
    assert all(keeps_special_tokens(f) for f in NEW)
    assert not keeps_special_tokens("hermes") and not keeps_special_tokens(None)
    assert output_family("harmony", False) == "harmony"
    assert output_family("gemma4", False) == "gemma4"
    assert output_family("glm45", False) is None and output_family("glm45", True) == "glm45"
    tools = [Tool("f", "", {"properties": {"a": {"type": "string"}}})]
    assert tool_schemas("glm45", tools) == {"f": {"properties": {"a": {"type": "string"}}}}
    assert tool_schemas("kimi_k2", tools) is None


def test_malformed_calls_come_back_as_text() -> None:
    for family, text in [
        ("glm45", "<tool_call>f<arg_key>a</arg_key></tool_call>"),
        ("kimi_k2", "<|tool_calls_section_begin|>oops<|tool_calls_section_end|>"),
        ("gemma4", "<|tool_call>get_weather(1)<tool_call|>"),
        ("pythonic", "[1, 2] are numbers"),
    ]:
        assert parse_output(text, family=family) == [Segment("text", text)], family


# ---- through the engine ---------------------------------------------------------

WEATHER = Tool(
    "get_weather",
    "Weather of a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
)


@pytest.fixture(scope="module")
def scripted():
    lm = scripted_model()
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=512, block_size=8))) as e:
        yield lm, e


@pytest.mark.parametrize("family", NEW)
def test_engine_emits_the_call(scripted, family: str) -> None:
    lm, engine = scripted
    lm.parser_family = family
    try:
        req = ChatRequest(
            messages=[Message("user", say(OUTPUTS[family]))],
            tools=[WEATHER],
            max_tokens=400,
            sampling=SamplingParams(temperature=0.0),
        )
        events = list(engine.generate_sync(req, timeout=60.0))
    finally:
        lm.parser_family = "hermes"
    assert isinstance(events[-1], Done)
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [CALL], events
