"""Fill-in-the-middle prompts (chat/fim.py) and raw prompts through the engine.

The prompt of each family is compared with one built by hand from the
tokenizer's own token ids; the engine's greedy output on a raw or FIM prompt
is compared with mlx-lm's own generation loop on the same ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from fim_fixtures import FAMILY_BOS, fim_model, fim_tokenizer, mlx_lm_generate
from mlx_cairn.chat.fim import fim_family, fim_prompt, fim_stop_ids
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.testing.engine_checks import engines_at_rest
from mlx_cairn.types import ChatRequest, Done, Message, RawPrompt, SamplingParams, TextDelta

PREFIX = "def add(x, y):\n    "
SUFFIX = "\n\nprint(add(1, 2))  # <|im_end|>\n"

#: (family, first token, second token, middle token or None): the prompt is
#: [BOS] first <one side> second <other side> [middle].
ORDER = {
    "qwen": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    "starcoder": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    "santacoder": ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    "deepseek": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    "codellama": ("▁<PRE>", "▁<SUF>", "▁<MID>"),
    "codestral": ("[SUFFIX]", "[PREFIX]", None),  # suffix first, no middle token
}


@pytest.mark.parametrize("family", sorted(ORDER))
def test_each_family_builds_its_own_order(family: str) -> None:
    tok = fim_tokenizer(family)
    first, second, middle = ORDER[family]
    tid = tok.token_to_id
    a, b = (SUFFIX, PREFIX) if family == "codestral" else (PREFIX, SUFFIX)
    by_hand = [tid(first), *tok.encode_plain(a), tid(second), *tok.encode_plain(b)]
    if middle is not None:
        by_hand.append(tid(middle))
    if family in FAMILY_BOS:
        by_hand.insert(0, tid(FAMILY_BOS[family]))
    assert fim_prompt(tok, PREFIX, SUFFIX) == by_hand
    assert fim_family(tok) is not None and fim_family(tok).name == family  # type: ignore[union-attr]


def test_special_token_text_in_the_code_is_data() -> None:
    tok = fim_tokenizer("qwen")
    ids = fim_prompt(tok, "<|fim_middle|>", "<|im_end|>")
    markers = [tok.token_to_id(t) for t in ("<|fim_middle|>", "<|im_end|>")]
    # Only the one middle token the builder adds, at the end.
    assert ids.count(markers[0]) == 1 and ids[-1] == markers[0]
    assert markers[1] not in ids


def test_a_model_without_fim_tokens_is_refused_on_suffix() -> None:
    with pytest.raises(InvalidRequest) as e:
        fim_prompt(fim_tokenizer(None), PREFIX, SUFFIX)
    assert e.value.param == "suffix" and "fill-in-the-middle" in e.value.message
    assert fim_stop_ids(fim_tokenizer(None)) == set()


def test_repository_context_goes_before_the_prefix() -> None:
    tok = fim_tokenizer("qwen")
    extra = [{"filename": "util.py", "text": "X = 1\n"}]
    ids = fim_prompt(tok, PREFIX, SUFFIX, extra)
    tid = tok.token_to_id
    head = [
        tid("<|repo_name|>"),
        *tok.encode_plain("myproject\n"),
        tid("<|file_sep|>"),
        *tok.encode_plain("util.py\n"),
        *tok.encode_plain("X = 1\n"),
        tid("<|file_sep|>"),
        *tok.encode_plain("filename\n"),
    ]
    assert ids == head + fim_prompt(tok, PREFIX, SUFFIX)


# ------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def coder() -> Any:
    return fim_model("qwen")


@pytest.fixture
def make(coder: Any) -> Iterator[Any]:
    with engines_at_rest(coder, num_blocks=64, block_size=8) as m:
        yield m


def _greedy(engine: Any, raw: RawPrompt, max_tokens: int) -> tuple[list[int], str, Done]:
    req = ChatRequest(
        messages=[], raw=raw, max_tokens=max_tokens, sampling=SamplingParams(temperature=0)
    )
    stream = engine.submit(engine.prepare(req))
    events = list(stream.iter_sync(timeout=60))
    done = events[-1]
    assert isinstance(done, Done)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    return stream.output_ids, text, done


def test_raw_prompt_greedy_equals_mlx_lm(coder: Any, make: Any) -> None:
    engine = make()
    text = "Hello world! <|im_start|>user\nHow are you"
    # Special-token text in a raw prompt is markup, as in Hugging Face's tokenizer(text).
    ids = coder.tokenizer.encode(text)
    assert coder.tokenizer.token_to_id("<|im_start|>") in ids
    out, _, done = _greedy(engine, RawPrompt(text=text), 12)
    assert out == mlx_lm_generate(coder, ids, 12, set(coder.eos_token_ids))
    assert done.usage.input_tokens == len(ids)
    # Token ids from the client are the prompt as they are.
    out_ids, _, _ = _greedy(engine, RawPrompt(ids=ids), 12)
    assert out_ids == out


def test_fim_greedy_equals_mlx_lm_on_the_hand_built_prompt(coder: Any, make: Any) -> None:
    engine = make()
    tok = coder.tokenizer
    tid = tok.token_to_id
    by_hand = [
        tid("<|fim_prefix|>"),
        *tok.encode_plain(PREFIX),
        tid("<|fim_suffix|>"),
        *tok.encode_plain(SUFFIX),
        tid("<|fim_middle|>"),
    ]
    stops = set(coder.eos_token_ids) | fim_stop_ids(tok)
    out, _, done = _greedy(engine, RawPrompt(text=PREFIX, suffix=SUFFIX), 16)
    assert out == mlx_lm_generate(coder, by_hand, 16, stops)
    assert done.usage.input_tokens == len(by_hand)


def test_end_of_middle_token_ends_a_fim_request_only(coder: Any, make: Any) -> None:
    """<|fim_pad|> and the file separator end a middle (not shown), whoever built
    the FIM prompt; a plain completion has no such stop."""
    engine = make()
    tok = coder.tokenizer
    pad = tok.token_to_id("<|fim_pad|>")
    assert pad is not None
    bias = SamplingParams(temperature=0, logit_bias={pad: 100.0})
    fim = ChatRequest(messages=[], raw=RawPrompt(text="x", suffix="y"), max_tokens=5, sampling=bias)
    stream = engine.submit(engine.prepare(fim))
    events = list(stream.iter_sync(timeout=60))
    assert stream.output_ids == [pad]
    assert isinstance(events[-1], Done) and events[-1].stop_reason == "end_turn"
    assert not [e for e in events if isinstance(e, TextDelta)]
    # A FIM prompt the client built itself (Continue, Zed) ends there too.
    own = "<|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>"
    by_client = ChatRequest(messages=[], raw=RawPrompt(text=own), max_tokens=5, sampling=bias)
    stream = engine.submit(engine.prepare(by_client))
    list(stream.iter_sync(timeout=60))
    assert stream.output_ids == [pad]
    plain = ChatRequest(messages=[], raw=RawPrompt(text="x"), max_tokens=5, sampling=bias)
    stream = engine.submit(engine.prepare(plain))
    events = list(stream.iter_sync(timeout=60))
    assert stream.output_ids == [pad] * 5 and events[-1].stop_reason == "max_tokens"


def test_raw_prompt_validation(coder: Any, make: Any) -> None:
    engine = make()
    for raw, param in (
        (RawPrompt(ids=[1, 10_000]), "prompt"),
        (RawPrompt(ids=[]), "prompt"),
        (RawPrompt(text=""), "prompt"),
    ):
        with pytest.raises(InvalidRequest) as e:
            engine.prepare(ChatRequest(messages=[], raw=raw))
        assert e.value.param == param
    with pytest.raises(InvalidRequest):
        engine.prepare(ChatRequest(messages=[Message("user", "x")], raw=RawPrompt(text="x")))
    # An empty suffix on a model without FIM tokens is a plain completion.
    chat = fim_model(None)
    with engines_at_rest(chat, num_blocks=16, block_size=8) as make_chat:
        e2 = make_chat()
        p = e2.prepare(ChatRequest(messages=[], raw=RawPrompt(text="abc", suffix=""), max_tokens=8))
        assert p.prompt_ids == chat.tokenizer.encode("abc")
        with pytest.raises(InvalidRequest) as e:
            e2.prepare(
                ChatRequest(messages=[], raw=RawPrompt(text="abc", suffix="d"), max_tokens=8)
            )
        assert e.value.param == "suffix"
