"""The embedded default model (SmolLM2-135M-Instruct GGUF): tokenizer, template, generation."""

from __future__ import annotations

import pytest

from mlx_cairn.engine.reference import GenerationStats, generate_tokens
from mlx_cairn.types import ChatRequest, Message, SamplingParams, Tool, ToolCall

pytestmark = pytest.mark.slow


def test_identity_and_metadata(default_model):
    lm = default_model
    assert lm.name == "SmolLM2-135M-Instruct"
    assert lm.source_format == "gguf"
    assert lm.identity.startswith("SmolLM2-135M-Instruct.Q4_1@") and lm.identity.endswith(
        ":float32"
    )
    assert lm.model.args.rope_traditional
    assert (lm.model.num_layers, lm.model.num_kv_heads, lm.model.head_dim) == (30, 3, 64)
    assert lm.model.vocab_size == lm.tokenizer.vocab_size == 49152
    assert lm.tokenizer.token_to_id("<|im_end|>") in lm.eos_token_ids
    assert lm.context_length == 8192
    assert not lm.reasoning.supported


@pytest.mark.parametrize(
    "text",
    [
        "What is the capital of France?",
        "  leading spaces, tabs\tand\nnewlines\n\n",
        "digits 1234567 and unicode: héllo 日本語 😀 ✓",
        "<|im_start|>user\nhi<|im_end|>",
        "def f(x):\n    return x ** 2  # comment",
    ],
)
def test_gguf_tokenizer_round_trips(default_model, text):
    tok = default_model.tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    detok = tok.detokenizer(skip_special_tokens=False)
    assert "".join(detok.add(i) for i in ids) + detok.flush() == text


def test_gguf_tokenizer_known_pieces(default_model):
    tok = default_model.tokenizer
    # Chat markup maps to single control tokens; digits split one by one (smollm pre-tokenizer).
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert len(tok.encode("1234")) == 4
    assert tok.encode(" Paris") == [tok.token_to_id("ĠParis")]


def test_greedy_answer_names_paris(default_model):
    lm = default_model
    prompt = lm.prompt(ChatRequest(messages=[Message("user", "What is the capital of France?")]))
    assert prompt.text.startswith("<|im_start|>system\n")
    assert prompt.text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    stats = GenerationStats()
    ids = list(
        generate_tokens(
            lm.model,
            prompt.ids,
            max_tokens=24,
            sampling=SamplingParams(temperature=0.0),
            eos_token_ids=lm.eos_token_ids,
            stats=stats,
        )
    )
    assert "Paris" in lm.tokenizer.decode(ids)
    assert stats.generated_tokens == len(ids) and stats.prompt_tokens == len(prompt.ids)


def test_template_renders_a_tool_conversation(default_model):
    lm = default_model
    tool = Tool(
        "get_weather",
        "Weather for a city",
        {"type": "object", "properties": {"city": {"type": "string"}}},
    )
    messages = [
        Message("system", "Be brief."),
        Message("user", "Weather in Paris?"),
        Message(
            "assistant", "", tool_calls=[ToolCall("call_1", "get_weather", '{"city": "Paris"}')]
        ),
        Message("tool", "21 C, sunny", tool_call_id="call_1", name="get_weather"),
        Message("assistant", "Sunny, 21 C."),
        Message("user", "And tomorrow?"),
    ]
    prompt = lm.prompt(ChatRequest(messages=messages, tools=[tool]))
    text = prompt.text
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n21 C, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n")
    assert (
        prompt.ids[:1] == [1] and lm.tokenizer.decode(prompt.ids, skip_special_tokens=False) == text
    )
    assert lm.parser_family == "hermes"
