"""Chat templates: HF semantics, tools, errors, and parser/reasoning detection."""

from __future__ import annotations

import json

import pytest

from mlx_cairn.chat import ChatTemplate, build_prompt, detect_parser_family, detect_reasoning
from mlx_cairn.chat.builtin_templates import CHATML, QWEN3
from mlx_cairn.errors import InvalidRequest, ModelLoadError
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import ChatRequest, Message, Tool, ToolCall

WEATHER = Tool(
    name="get_weather",
    description="Current weather for a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


def conversation() -> list[Message]:
    return [
        Message("system", "You are terse."),
        Message("user", "Weather in Paris?"),
        Message(
            "assistant",
            "",
            tool_calls=[ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')],
        ),
        Message("tool", '{"temp_c": 21}', tool_call_id="call_1", name="get_weather"),
        Message("assistant", "It is 21 °C."),
        Message("user", "Thanks!"),
    ]


def test_qwen_style_template_with_tools():
    tpl = ChatTemplate(QWEN3, eos_token="<|im_end|>")
    text = tpl.render(conversation(), tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    tool_line = json.dumps(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER.description,
                "parameters": WEATHER.parameters,
            },
        },
        ensure_ascii=False,
    )
    assert f"<tools>\n{tool_line}\n</tools>" in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>' in text
    assert "It is 21 °C.<|im_end|>" in text  # tojson and text keep non-ASCII as is
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    off = tpl.render(conversation(), tools=[WEATHER], enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    no_prompt = tpl.render(conversation()[:2], add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")


def test_reasoning_content_of_the_last_turn_is_rendered():
    tpl = ChatTemplate(QWEN3)
    msgs = [Message("user", "2+2?"), Message("assistant", "4", reasoning="add them")]
    text = tpl.render(msgs, add_generation_prompt=False)
    assert "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>" in text


def test_template_without_tool_support_gets_hermes_text():
    tpl = ChatTemplate(CHATML)
    text = tpl.render(conversation(), tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    assert '"name": "get_weather"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>' in text
    assert tiny_model("llama").parser_family == "hermes"


def test_hf_helpers_and_variables():
    src = (
        "{{ bos_token }}{% for m in messages %}{{ m.role }}={{ m.content | tojson }};{% endfor %}"
        "{{ {'a': 'é<>'} | tojson }}|{{ strftime_now('%Y') | length }}|{{ custom }}"
        "{% for i in range(3) %}{% if i == 1 %}{% break %}{% endif %}{{ i }}{% endfor %}"
        "{% generation %}G{% endgeneration %}"
    )
    tpl = ChatTemplate(src, bos_token="<s>")
    out = tpl.render([Message("user", 'say "hi"')], custom="X")
    assert out == '<s>user="say \\"hi\\"";{"a": "é<>"}|4|X0G'
    assert tpl.adds_bos


def test_template_errors_are_invalid_request():
    tpl = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    )
    with pytest.raises(InvalidRequest, match="first must be user"):
        tpl.render([Message("system", "x")])
    with pytest.raises(InvalidRequest, match="chat template failed"):
        ChatTemplate("{{ messages[0].content.nope() }}").render([Message("user", "x")])
    with pytest.raises(InvalidRequest, match="chat template failed"):
        ChatTemplate("{{ messages[5].content + 1 }}").render([Message("user", "x")])
    with pytest.raises(ModelLoadError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_sandbox_blocks_attribute_escapes():
    tpl = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequest):
        tpl.render([Message("user", "x")])


@pytest.mark.parametrize(
    "source, vocab, family",
    [
        (QWEN3, set(), "hermes"),
        ("{{ '<tool_call>\\n<function=' }}{{ tools }}", set(), "qwen3_coder"),
        ("{{ '<|python_tag|>' }}", set(), "llama3"),
        ("{% if m.role == 'ipython' %}<|eot_id|>{% endif %}", set(), "llama3"),
        ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", set(), "mistral"),
        (CHATML, set(), None),
        ("{{ tools }}", {"<tool_call>"}, "hermes"),
    ],
)
def test_parser_family_detection(source, vocab, family):
    assert detect_parser_family(source, vocab) == family


def test_reasoning_detection():
    qwen = detect_reasoning(QWEN3)
    assert qwen.supported and qwen.kwarg == "enable_thinking" and qwen.default_on
    assert not detect_reasoning(CHATML, {"<think>", "</think>"}).supported
    opt_in = detect_reasoning(
        "{% if enable_thinking is defined and enable_thinking is true %}<think>{% endif %}"
    )
    assert opt_in.supported and not opt_in.default_on


def test_build_prompt_reasoning_and_bos():
    lm = tiny_model("qwen3")
    req = ChatRequest(messages=[Message("user", "Hi")], reasoning=False)
    p = lm.prompt(req)
    assert p.text.endswith("<think>\n\n</think>\n\n") and not p.in_reasoning
    assert p.ids == lm.tokenizer.encode(p.text)
    opener = ChatTemplate("{{ messages[0].content }}<|im_start|>assistant\n<think>\n")
    p2 = build_prompt(
        ChatRequest(messages=[Message("user", "Hi")]), opener, lm.tokenizer, lm.reasoning
    )
    assert p2.in_reasoning
    lm.tokenizer.bos_token = "<|endoftext|>"
    lm.tokenizer.bos_token_id = lm.tokenizer.token_to_id("<|endoftext|>")
    lm.tokenizer.add_bos = True
    p3 = lm.prompt(ChatRequest(messages=[Message("user", "Hi")]))
    assert p3.ids[0] == lm.tokenizer.bos_token_id and p3.ids[1:] == lm.tokenizer.encode(p3.text)


def test_tool_choice_none_hides_tools():
    lm = tiny_model("qwen3")
    with_tools = lm.prompt(ChatRequest(messages=[Message("user", "Hi")], tools=[WEATHER]))
    hidden = lm.prompt(
        ChatRequest(messages=[Message("user", "Hi")], tools=[WEATHER], tool_choice="none")
    )
    assert "get_weather" in with_tools.text and "get_weather" not in hidden.text
