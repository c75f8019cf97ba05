"""Forced tool calls in every parser family's own syntax: the grammar accepts a valid call,
refuses a wrong tool or a bad argument, and whatever is sampled under its mask is read
back by that family's Rust parser as calls to allowed tools with valid arguments."""

from __future__ import annotations

import functools
import json

import jsonschema
import numpy as np
import pytest
from tokenizers import AddedToken

from mlx_cairn import constrain
from mlx_cairn._core import GrammarVocabulary
from mlx_cairn.constrain.compile import compile_grammar
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.testing.engine_checks import assert_at_rest, submit_together
from mlx_cairn.testing.tiny_models import tiny_model, tiny_tokenizer
from mlx_cairn.text import keeps_special_tokens, parse_output, tool_schemas
from mlx_cairn.types import ChatRequest, Message, Tool

TOOLS = [
    Tool("get_weather", "Current weather for a city", {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}),
    Tool("add", "Add two numbers", {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}),
    Tool("book", "File a book", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 12},
            "code": {"type": "string", "pattern": "^[0-9]{3}$"},  # looks like JSON
            "draft": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
            "meta": {"type": "object", "properties": {
                "pages": {"type": "integer", "minimum": 1, "maximum": 999},
                "isbn": {"type": ["string", "null"]}}, "required": ["pages"]}},
        "required": ["title", "code", "draft"], "additionalProperties": False}),
    Tool("note", "Anything", {"type": "object"}),
]  # fmt: skip
BY_NAME = {t.name: t for t in TOOLS}

#: The family texts each model's tokenizer has as special tokens (as the real
#: checkpoints do), and closing tags some have as plain added tokens.
SPECIALS = {
    "hermes": [],
    "llama3": [],
    "mistral": ["[TOOL_CALLS]"],
    "qwen3_coder": [],
    "glm45": [],
    "minimax_m2": ["<minimax:tool_call>", "</minimax:tool_call>"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"],
    "harmony": ["<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>"],
    "gemma4": ["<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>"],
    "pythonic": ["<|python_start|>", "<|python_end|>"],
}  # fmt: skip
ADDED = ["</parameter>", "<parameter=", "<function=", "</function>", "<arg_key>", "</arg_key>",
         "<arg_value>", "</arg_value>", "<invoke name=", "</invoke>", "<parameter name="]  # fmt: skip

#: The tags that end a value: the sampler favours finishing one it has begun.
CLOSERS = ["\n</parameter>\n", "</arg_value>", "</parameter>\n", "</invoke>", '"', "]", "}"]

#: A valid call of ``get_weather`` (city Paris, celsius) in each family's syntax.
VALID = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
    '</parameter>\n<parameter name="unit">celsius</parameter>\n</invoke>\n</minimax:tool_call>',
    "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", '
    '"unit": "celsius"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris", "unit": "celsius"}<|tool_call_end|>'
    "<|tool_calls_section_end|>",
    "harmony": "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary"
    ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "celsius"}',
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>',
    "pythonic": '[get_weather(city="Paris", unit="celsius")]',
}
#: (wrong tool name, an argument outside the schema) versions of VALID.
INVALID = {
    f: [v.replace("get_weather", "get_time"), v.replace("celsius", "kelvin")]
    for f, v in VALID.items()
}
#: Families whose calls each sit in a section of their own, or several share one.
FAMILIES = list(VALID)


def test_every_parser_family_has_a_grammar():
    from mlx_cairn.text import FAMILIES as PARSER

    assert set(constrain.GRAMMAR_FAMILIES) == set(PARSER) == set(VALID)


class Family:
    """A tokenizer with ``family``'s markers, its grammar vocabulary, and the parser's view."""

    def __init__(self, config: str) -> None:
        family, _, variant = config.partition("/")
        specials = SPECIALS[family] + (SPECIAL_TAGS[family] if variant else [])
        tok = tiny_tokenizer()
        tok.hf.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t in ADDED if t not in specials]
        )
        tok.hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        self.family, self.tok = family, tok
        self.eos = tok.hf.token_to_id("<|im_end|>")
        self.n = tok.hf.get_vocab_size()
        self.vocab = GrammarVocabulary(tok.hf.to_str(), [self.eos], self.n)
        self.specials = tok.special_tokens

    def grammar(self, tools: list[Tool], parallel: bool):
        text = constrain.tool_grammar(self.family, tools, parallel=parallel, specials=self.specials)
        assert text is not None
        return self.vocab.compile_lark(text)

    def accepts(self, grammar, text: str) -> bool:
        m = self.vocab.matcher(grammar)
        for t in self.tok.encode(text):
            if np.frombuffer(m.mask(), np.float32)[t] != 0.0:
                return False
            m.consume(t)
        return m.is_accepting()

    def decode(self, ids: list[int]) -> str:
        # The engine decodes these families with special tokens kept. Mistral's
        # [TOOL_CALLS] is a special token too, but mlx_cairn.text does not list
        # mistral among them yet (see SPECIAL_TOKEN_FAMILIES): kept here.
        keep = keeps_special_tokens(self.family) or self.family == "mistral"
        return self.tok.decode(ids, skip_special_tokens=not keep)

    def calls(self, text: str, tools: list[Tool]) -> tuple[list, str]:
        segs = parse_output(
            text, self.family, tool_schemas=tool_schemas(self.family, tools) or None
        )
        calls = [s for s in segs if s.kind == "tool_call"]
        rest = "".join(s.text for s in segs if s.kind == "text")
        return calls, rest

    def sample(self, grammar, rng: np.random.Generator, max_steps: int = 2000) -> tuple[str, bool]:
        """Random tokens under the mask: (their text, whether the turn ended).

        Tokens are drawn uniformly, except that structure (closing brackets
        and quotes, added and special tokens, the end of turn) is favoured
        more and more, so that free text ends in reasonable time."""
        m = self.vocab.matcher(grammar)
        ids: list[int] = []
        for step in range(max_steps):
            allowed = np.flatnonzero(np.frombuffer(m.mask(), np.float32) == 0.0)
            assert allowed.size, f"no token allowed after {self.decode(ids)!r}"
            rems = self._remainders(self.decode(ids[-4:]))
            boost = 20.0 ** (1 + step / 20)
            texts = self.texts
            ends = self.ends
            w = self.weights[allowed] * [
                boost * (5 if t == self.eos else 1)
                if t in ends or any(r.startswith(texts[t]) for r in rems)
                else 1.0
                for t in allowed
            ]
            t = int(rng.choice(allowed, p=w / w.sum()))
            if t == self.eos:
                return self.decode(ids), True
            m.consume(t)
            ids.append(t)
        return self.decode(ids), False

    @staticmethod
    def _remainders(tail: str) -> list[str]:
        """What is left of each closing tag that ``tail`` has begun (or of one not begun)."""
        return [c[k:] for c in CLOSERS for k in range(len(c)) if tail.endswith(c[:k])]

    @functools.cached_property
    def ends(self) -> set[int]:
        """The end of turn, special tokens and closing tags."""
        added = {i for i, t in enumerate(self.texts) if t in ADDED and t.startswith("</")}
        return {self.eos, *self.specials.values(), *added}

    @functools.cached_property
    def texts(self) -> list[str]:
        return [self.tok.decode([t], skip_special_tokens=False) for t in range(self.n)]

    @functools.cached_property
    def weights(self) -> np.ndarray:
        w = np.ones(self.n)
        for t in range(self.n):
            text = self.tok.decode([t], skip_special_tokens=False)
            structure = t == self.eos or t in self.specials.values() or text in ADDED
            if structure or (text and all(c in '"}])>\n,' for c in text)):
                w[t] = 6.0
            elif not any(c.isalnum() for c in text):
                w[t] = 2.0
        return w


#: Families also tried with their tags as special tokens (GLM-4.5's tokenizer has
#: ``<arg_key>``.. as special tokens; the grammar then matches them as tokens).
SPECIAL_TAGS = {
    "glm45": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
              "</arg_value>"],
    "harmony": ["<|call|>"],
}  # fmt: skip


@pytest.fixture(scope="module", params=[*FAMILIES, *(f"{f}/special-tags" for f in SPECIAL_TAGS)])
def fam(request) -> Family:
    return Family(request.param)


def test_a_valid_call_is_accepted_and_parses(fam):
    g = fam.grammar(TOOLS, parallel=False)
    assert fam.accepts(g, VALID[fam.family]), VALID[fam.family]
    calls, rest = fam.calls(VALID[fam.family], TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    assert rest.strip() == ""


def test_a_wrong_tool_or_a_bad_argument_is_refused(fam):
    g = fam.grammar(TOOLS, parallel=True)
    for bad in INVALID[fam.family]:
        assert not fam.accepts(g, bad), bad
    named = fam.grammar([BY_NAME["add"]], parallel=True)
    assert not fam.accepts(named, VALID[fam.family])


def test_a_schema_silent_on_other_keys_refuses_them(fam):
    """No ``additionalProperties`` (langchain's ``@tool`` schemas): a forced call holds
    only the listed keys (:func:`mlx_cairn.constrain.closed`)."""
    open_schema = {k: v for k, v in BY_NAME["get_weather"].parameters.items()}
    del open_schema["additionalProperties"]
    g = fam.grammar([Tool("get_weather", "", open_schema)], parallel=False)
    assert fam.accepts(g, VALID[fam.family])
    sampled = [fam.sample(g, np.random.default_rng(i))[0] for i in range(4)]
    for text in sampled:
        calls, _ = fam.calls(text, TOOLS)
        for c in calls:
            assert set(json.loads(c.arguments)) <= {"city", "unit"}, text
    if fam.family == "hermes":
        bad = VALID["hermes"].replace('"city": "Paris"', '"city": "Paris", "properties": {}')
        assert not fam.accepts(g, bad), bad


@pytest.mark.parametrize("parallel", [False, True])
def test_sampled_calls_parse_and_validate(fam, parallel):
    """The end-to-end property: random sampling under the mask always yields text the
    family's parser reads as calls of allowed tools whose arguments validate."""
    g = fam.grammar(TOOLS, parallel)
    rng = np.random.default_rng(sum(map(ord, fam.family)) + parallel)
    counts = []
    for _ in range(8):
        text, ended = fam.sample(g, rng)
        assert ended, f"no end of turn: {text!r}"
        calls, rest = fam.calls(text, TOOLS)
        assert calls and rest.strip() == "", text
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), BY_NAME[c.name].parameters)
        counts.append(len(calls))
    if not parallel:
        assert set(counts) == {1}


def test_a_named_tool_is_the_one_called(fam):
    for name in ("add", "book"):
        g = fam.grammar([BY_NAME[name]], parallel=False)
        rng = np.random.default_rng(7)
        for _ in range(4):
            text, ended = fam.sample(g, rng)
            assert ended, text
            calls, _ = fam.calls(text, TOOLS)
            assert [c.name for c in calls] == [name]
            jsonschema.validate(json.loads(calls[0].arguments), BY_NAME[name].parameters)


def test_a_structured_answer_or_a_call(fam):
    """Structured output with tools offered: an answer matching the schema, or a call."""
    schema = constrain.styled({"type": "object", "properties": {"a": {"type": "integer"}},
                               "required": ["a"], "additionalProperties": False})  # fmt: skip
    tools = constrain.tool_grammar(fam.family, TOOLS, parallel=True, specials=fam.specials)
    g = fam.vocab.compile_lark(constrain.either(tools, schema))
    assert fam.accepts(g, '{"a": 1}') and fam.accepts(g, '{\n  "a": 1\n}')
    assert fam.accepts(g, VALID[fam.family])
    assert not fam.accepts(g, '{"b": 1}')


def test_strict_tools_under_auto_wait_for_the_opening_tag(fam):
    """Free text stays free; once the family's opening tag is written, the call is held to
    its strict schema (families without an opening tag get no lazy grammar)."""
    strict = [Tool(t.name, t.description, t.parameters, strict=True) for t in TOOLS]
    text = constrain.strict_tools_grammar(
        fam.family, strict, parallel=True, specials=fam.specials, eos=[fam.eos]
    )
    if fam.family not in constrain.OPEN_TAGS:
        assert text is None
        return
    g = fam.vocab.compile_lark(text)
    assert fam.accepts(g, "Sure, I can help with that.")
    assert fam.accepts(g, "Let me check. " + VALID[fam.family])
    for bad in INVALID[fam.family]:
        assert not fam.accepts(g, "Let me check. " + bad), bad
    if fam.family == "gemma4":  # other special tokens stay free: Gemma 4's thought channel
        assert fam.accepts(g, "<|channel>thought\nplan<channel|>" + VALID["gemma4"])


def test_what_a_syntax_cannot_write_is_refused_before_any_work():
    """A tool name pythonic cannot write, a keyword no grammar enforces: a 400, not a
    call that is left unconstrained."""
    with pytest.raises(ValueError, match="get-weather"):
        constrain.tool_grammar("pythonic", [Tool("get-weather", "", {})], parallel=False)
    for family in ("gemma4", "qwen3_coder", "pythonic"):
        with pytest.raises(ValueError, match="uniqueItems"):
            constrain.tool_grammar(
                family,
                [Tool("f", "", {"properties": {"a": {"type": "array", "uniqueItems": True}}})],
                parallel=False,
            )
    lm = tiny_model("qwen3", seed=1)  # hermes
    req = ChatRequest(
        [Message("user", "x")], tools=[Tool("get-weather", "", {})], tool_choice="required"
    )
    assert compile_grammar(lm, req) is not None
    unique = Tool("f", "", {"type": "array", "uniqueItems": True})
    with pytest.raises(InvalidRequest) as e:
        compile_grammar(
            lm, ChatRequest([Message("user", "x")], tools=[unique], tool_choice="required")
        )
    assert e.value.param == "tools"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_embedded_model_calls_in_every_family(default_model):
    """On the real 135M model and its 49k vocabulary, with each family's grammar and
    parser: a forced call that ends is one valid call of the right tool, in every
    family. The model has never seen most of these syntaxes and can loop inside a
    raw-text value until max_tokens (bench/RESULTS.md counts how often)."""
    import dataclasses

    from mlx_cairn.engine import Engine, EngineConfig
    from mlx_cairn.engine.prepare import prepare
    from mlx_cairn.types import Done, SamplingParams, ToolCall

    cases = [
        ("What is 2 plus 3?", "add"),
        ("Weather in Paris?", "get_weather"),
        # Counted and patterned raw text: within llguidance's lexer budget on 49k tokens.
        ("File the book Dune, code 123.", "book"),
    ]
    reqs = [
        ChatRequest(
            [Message("user", prompt)],
            max_tokens=160,
            sampling=SamplingParams(temperature=0.0),
            tools=TOOLS[:3],
            tool_choice={"name": name},
            parallel_tool_calls=False,
        )
        for prompt, name in cases
    ]
    # A request carries its family (grammar and output parser): every family's rows
    # run in one engine, one batch, as one model's rows do on a server.
    rows = len(FAMILIES) * len(cases)
    engine = Engine(default_model, EngineConfig(max_batch=rows, num_blocks=512))
    try:
        prepared = []
        for family in FAMILIES:
            lm = dataclasses.replace(default_model, parser_family=family)
            for r in reqs:
                p = prepare(lm, r, context_length=engine.context_length, max_tokens_capacity=4096)
                assert p.parser_family == family
                prepared.append((family, p))
        # Every prompt shares the ~450-token tools prompt: one token of the first puts
        # it in the prefix cache, so the batch prefills only what differs.
        warm = dataclasses.replace(prepared[0][1], max_tokens=1)
        list(engine.submit(warm).iter_sync(300))
        streams = zip(
            [f for f, _ in prepared],
            submit_together(engine, [p for _, p in prepared]),
            strict=True,
        )
        ended = 0
        for (family, s), (_, name) in zip(streams, cases * len(FAMILIES), strict=True):
            events = list(s.iter_sync(300))
            calls = [e for e in events if isinstance(e, ToolCall)]
            done = events[-1]
            assert isinstance(done, Done), (family, events)
            for c in calls:  # a cut one may still hold a whole call
                assert c.name == name, (family, events)
                jsonschema.validate(json.loads(c.arguments), BY_NAME[name].parameters)
            if done.stop_reason == "max_tokens":
                continue
            assert done.stop_reason == "tool_use" and len(calls) == 1, (family, events)
            ended += 1
        assert_at_rest(engine)
    finally:
        engine.close()
    assert ended >= 0.75 * len(FAMILIES) * len(cases), ended
