"""Any schema a client sends either compiles or is a 400 naming why: never a crash."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_cairn import constrain
from mlx_cairn.constrain import GrammarMask
from mlx_cairn.constrain.compile import compile_grammar
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import ChatRequest, Message, OutputFormat

KEYS = [
    "type", "properties", "items", "required", "enum", "const", "anyOf", "oneOf", "allOf",
    "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "$ref", "$defs",
    "additionalProperties", "minimum", "maximum", "prefixItems", "not", "uniqueItems",
]  # fmt: skip
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 50), st.floats(allow_nan=False, width=32),
    st.sampled_from(["string", "integer", "object", "array", "number", "boolean", "null",
                     "#/$defs/a", "^[a-z]+$", "date", "email", "x"]),
)  # fmt: skip
schemas = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=4)), inner, max_size=4),
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", seed=2)


@settings(max_examples=150, deadline=None)
@given(schema=schemas)
def test_random_schemas_compile_or_are_refused(lm, schema):
    req = ChatRequest([Message("user", "x")], output_format=OutputFormat(schema))  # type: ignore[arg-type]
    try:
        grammar = compile_grammar(lm, req)
    except InvalidRequest as e:
        assert e.param == "response_format" and str(e)
        return
    if grammar is not None:  # it compiled: a matcher gives a mask of the logits' width
        m = constrain.vocabulary(lm).matcher(grammar)
        assert len(m.mask()) == 4 * constrain.vocabulary(lm).width


class _Seq:
    def __init__(self, prompt: list[int], out: list[int]) -> None:
        self.tokens = prompt + out
        self.num_prompt = len(prompt)


def test_a_grammar_waits_for_the_end_of_reasoning(lm):
    """Generation that starts inside reasoning is free until the close tag, then constrained."""
    vocab = constrain.vocabulary(lm)
    grammar = vocab.compile_json_schema(constrain.styled({"type": "boolean"}))
    close = lm.tokenizer.encode("</think>")
    mask = GrammarMask(vocab.matcher(grammar), close)
    thinking = lm.tokenizer.encode("let me see")
    assert mask.mask(_Seq([1, 2], thinking), vocab.width) is None
    after = mask.mask(_Seq([1, 2], thinking + close), vocab.width)
    assert after is not None
    allowed = [i for i, v in enumerate(after.tolist()) if v == 0.0]
    texts = {lm.tokenizer.decode([i]) for i in allowed}
    assert texts and all("true".startswith(t) or "false".startswith(t) for t in texts), texts


def test_closed_reads_silence_on_other_keys_as_none():
    """Forced and strict tool arguments: an object that lists properties and says
    nothing of others takes no others; what says otherwise is kept."""
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "free": {"type": "object"},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "list": {"type": "array", "items": {"properties": {"y": {}}}},
            "both": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]},
        },
        "$defs": {"d": {"properties": {"z": {}}}},
        "anyOf": [{"properties": {"k": {}}}],
    }
    out = constrain.closed(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert props["a"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False
    assert all("additionalProperties" not in p for p in props["both"]["allOf"])
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the client's schema is not changed
