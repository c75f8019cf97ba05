"""Vision-language models on the engine (issue 34): tiny random-weight checkpoints per
architecture, written with mlx-vlm's own classes; greedy tokens of image prompts,
batched with other requests through our Engine, equal mlx-vlm's own generation on the
same folder; the prefix cache and the feature cache know the picture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image as PILImage

from mlx_cairn.backends.cpu import attention as cpu_attention
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.models import load
from mlx_cairn.testing.engine_checks import assert_at_rest, greedy_reference, submit_together
from mlx_cairn.testing.tiny_vision import tiny_vision_folder
from mlx_cairn.types import (
    IMAGE_MARK,
    Admitted,
    ChatRequest,
    Done,
    Image,
    Message,
    SamplingParams,
    TokenLogprob,
)

#: Picture size per architecture (the processor's smallest, so each test runs in seconds).
SIZES = {
    "gemma3": (28, 28),
    "qwen2_5_vl": (56, 56),
    "qwen3_vl": (64, 64),
    "qwen3_5": (64, 64),
    "idefics3": (28, 28),
    "smolvlm": (28, 28),
    "mistral3": (28, 28),
}
ARCHES = list(SIZES)


@pytest.fixture(scope="module", params=ARCHES)
def model(request: Any, tmp_path_factory: Any) -> tuple[str, Any, Path]:
    arch = request.param
    folder = tiny_vision_folder(arch, tmp_path_factory.mktemp(arch))
    return arch, load(str(folder)), folder


@pytest.fixture(scope="module")
def mlx_vlm_model(model: tuple[str, Any, Path]) -> tuple[Any, Any]:
    from mlx_vlm.utils import load as vlm_load

    return vlm_load(str(model[2]))


def picture(arch: str, seed: int, wide: int = 1) -> Image:
    w, h = SIZES[arch]
    w *= wide
    rng = np.random.default_rng(seed)
    return Image.from_pil(PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))


def ask(
    text: str, images: list[Image], max_tokens: int = 8, history: Any = (), logprobs: bool = False
) -> ChatRequest:
    content = IMAGE_MARK * len(images) + text
    return ChatRequest(
        messages=[*history, Message("user", content, images=list(images))],
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, logprobs=logprobs),
    )


def mlx_vlm_greedy(
    lm: Any, vlm: tuple[Any, Any], req: ChatRequest
) -> tuple[list[int], list[float]]:
    """mlx-vlm's own generation on the same prompt: its processor over the rendered text
    (whose ids must be ours), its model, its caches."""
    from mlx_vlm.utils import prepare_inputs

    model, processor = vlm
    prompt = lm.prompt(req)
    pics = [im.pixels for m in req.messages for im in m.images]
    inputs = prepare_inputs(processor, images=pics, prompts=prompt.text)
    ids = inputs["input_ids"]
    assert ids[0].tolist() == prompt.ids  # the processor's own expansion of the whole prompt
    extra = {
        k: v
        for k, v in inputs.items()
        if k not in ("input_ids", "pixel_values", "attention_mask") and v is not None
    }
    out: list[int] = []
    logprobs: list[float] = []
    with cpu_attention.disabled():  # mlx-vlm's own attention, even in patched modules
        for tok, lp in _generate(ids, model, inputs, req.max_tokens, extra):
            out.append(int(tok))
            logprobs.append(float(lp[int(tok)].item()))
            if tok in lm.eos_token_ids:
                break
    return out, logprobs


def _generate(ids: Any, model: Any, inputs: Any, max_tokens: int, extra: Any) -> Any:
    from mlx_vlm.generate.ar import generate_step

    yield from generate_step(
        ids,
        model,
        inputs["pixel_values"],
        inputs["attention_mask"],
        max_tokens=max_tokens,
        temperature=0.0,
        **extra,
    )


def run(
    engine: Engine, reqs: list[ChatRequest], logprobs: list[list[float]] | None = None
) -> list[tuple[list[int], Done, Admitted]]:
    streams = submit_together(engine, reqs)  # they share steps
    out = []
    for s in streams:
        events = list(s.iter_sync(timeout=120.0))
        done = events[-1]
        assert isinstance(done, Done), done
        admitted = next(e for e in events if isinstance(e, Admitted))
        out.append((list(s.output_ids), done, admitted))
        if logprobs is not None:
            logprobs.append([e.logprob for e in events if isinstance(e, TokenLogprob)])
    return out


def test_loads_as_a_vision_model(model: tuple[str, Any, Path]) -> None:
    _arch, lm, _ = model
    assert lm.takes_images is True
    assert lm.vision is not None
    # A text request renders and counts as for any model.
    assert lm.prompt(ChatRequest(messages=[Message("user", "Hi")])).media is None


def test_template_gets_content_parts(model: tuple[str, Any, Path]) -> None:
    """Text on both sides of the picture survives the template (parts, not a string)."""
    arch, lm, _ = model
    img = picture(arch, 0)
    req = ChatRequest(
        messages=[Message("user", f"before {IMAGE_MARK} after", images=[img])], max_tokens=4
    )
    p = lm.prompt(req)
    assert "before" in p.text and "after" in p.text
    assert len(p.media.spans) == 1
    span = p.media.spans[0]
    assert p.ids[span.start : span.end] == list(span.ids)
    assert len(span.ids) > 1  # expanded to the model's image tokens


def test_greedy_equals_mlx_vlm_batched(
    model: tuple[str, Any, Path], mlx_vlm_model: tuple[Any, Any]
) -> None:
    """Image prompts (one picture, two pictures, a picture again) batched with a text
    prompt, prefilled in chunks that cut through the image tokens, decoded together:
    each row's greedy tokens, and their log-probabilities, are mlx-vlm's own."""
    arch, lm, _ = model
    a, b = picture(arch, 1), picture(arch, 2)
    reqs = [
        ask("What is this?", [a], logprobs=True),
        ask("Hello there", []),
        ask("Compare them.", [a, b], logprobs=True),
        ask("And this wide one?", [b, picture(arch, 3, wide=2)], logprobs=True),
        ask("Describe it", [b], logprobs=True),
    ]
    with Engine(lm, EngineConfig(num_blocks=96, block_size=4, step_token_budget=8)) as engine:
        lps: list[list[float]] = []
        got = run(engine, reqs, lps)
        for req, (ids, done, _), lp in zip(reqs, got, lps, strict=True):
            assert done.usage.input_tokens == engine.count_tokens(req)
            assert done.usage.input_tokens == len(lm.prompt(req).ids)
            assert ids  # an empty answer would compare equal too
            if req.messages[-1].images:
                want, want_lp = mlx_vlm_greedy(lm, mlx_vlm_model, req)
                assert ids == want, req.messages[-1].content
                # The same distribution, not only the same argmax.
                np.testing.assert_allclose(lp, want_lp, atol=2e-3)
            else:  # a text row of a vision model: the one-sequence reference loop's
                assert ids == greedy_reference(lm, lm.prompt(req).ids, req.max_tokens)
        assert_at_rest(engine)


def test_prefix_cache_knows_the_picture(model: tuple[str, Any, Path]) -> None:
    """Next turn with the same picture reads the KV of the whole first turn (the image
    included) from the cache; the same text with another picture shares nothing past
    the block holding that picture's first token; each answers its own picture."""
    arch, lm, _ = model
    a, b = picture(arch, 3), picture(arch, 4)
    bs = 4
    first = ask("What is this?", [a])
    with Engine(lm, EngineConfig(num_blocks=128, block_size=bs)) as engine:
        [(ids1, _done1, _)] = run(engine, [first])
        encoded = lm.vision.encoded
        turn2 = ask(
            "And now?",
            [],
            history=[*first.messages, Message("assistant", lm.tokenizer.decode(ids1))],
        )
        [(_, _done2, adm2)] = run(engine, [turn2])
        span = lm.prompt(first).media.spans[0]
        assert adm2.cached_tokens >= span.end, (adm2.cached_tokens, span.end)
        assert lm.vision.encoded == encoded  # the cached KV covered it: no features needed
        other = ask("What is this?", [b])
        [(ids_b, _, adm_b)] = run(engine, [other])
        assert adm_b.cached_tokens <= span.start // bs * bs, (adm_b.cached_tokens, span.start)
        assert lm.vision.encoded == encoded + 1
        assert_at_rest(engine)
    # Each picture's answer is the one a fresh engine gives it alone.
    for req, want in ((first, ids1), (other, ids_b)):
        with Engine(lm, EngineConfig(num_blocks=64, block_size=bs)) as fresh:
            [(alone, _, _)] = run(fresh, [req])
        assert alone == want


def test_resent_picture_is_not_encoded_again(model: tuple[str, Any, Path]) -> None:
    """A picture whose KV is gone (another engine, no shared prefix) still reuses its
    vision features: the tower runs once per picture."""
    arch, lm, _ = model
    pic = picture(arch, 5)
    with Engine(lm, EngineConfig(num_blocks=64, block_size=4)) as engine:
        run(engine, [ask("One", [pic])])
        n = lm.vision.encoded
        moved = ask("Two words", [pic], history=[Message("user", "x"), Message("assistant", "y")])
        [(_, _, adm)] = run(engine, [moved])
        assert adm.cached_tokens <= lm.prompt(moved).media.spans[0].start  # no KV of the picture
        assert lm.vision.encoded == n
        assert_at_rest(engine)


def test_model_listing_says_vision(model: tuple[str, Any, Path], tmp_path: Path) -> None:
    """``/v1/models`` entries carry ``capabilities.vision``: from the folder before a
    load, from the loaded model after; a text folder says False."""
    from mlx_cairn.api.app import _with_loaded
    from mlx_cairn.api.registry import ServedModel, _info

    _, lm, folder = model
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text('{"model_type": "qwen3"}')
    infos = [
        _info("v", ServedModel(names=["v"], source=str(folder))),
        _info("v2", ServedModel(names=["v2"], source="elsewhere", loaded=lm)),
        _info("t", ServedModel(names=["t"], source=str(text))),
    ]
    body = _with_loaded({"data": [{} for _ in infos]}, infos)
    assert [e["capabilities"]["vision"] for e in body["data"]] == [True, True, False]


def test_disk_tier_knows_the_picture(model: tuple[str, Any, Path], tmp_path: Path) -> None:
    """After a restart, the same conversation and picture read their KV from the disk
    tier; another picture with the same text reads none past it; answers are unchanged."""
    arch, lm, _ = model
    a, b = picture(arch, 6), picture(arch, 7)
    first = ask("What is this?", [a])
    disk = tmp_path / "kv"
    with Engine(
        lm, EngineConfig(num_blocks=96, block_size=4, kv_disk_dir=disk, kv_disk_gb=0.1)
    ) as e:
        [(want, _, _)] = run(e, [first])
    span = lm.prompt(first).media.spans[0]
    with Engine(
        lm, EngineConfig(num_blocks=96, block_size=4, kv_disk_dir=disk, kv_disk_gb=0.1)
    ) as e:
        [(got, done, _)] = run(e, [first])
        assert done.usage.cached_tokens >= span.end, (done.usage.cached_tokens, span.end)
        assert e.stats().disk_hit_blocks > 0
        other = ask("What is this?", [b])
        [(_, done_b, _)] = run(e, [other])
        assert done_b.usage.cached_tokens <= span.start, (done_b.usage.cached_tokens, span.start)
        assert_at_rest(e)
    assert got == want


def test_image_inside_a_tool_result(
    model: tuple[str, Any, Path], mlx_vlm_model: tuple[Any, Any]
) -> None:
    """A tool-role message carries pictures too (an Anthropic tool_result with an image):
    rendered as content parts (through the tool-result fallback of templates without
    tools too), expanded, and answered."""
    arch, lm, _ = model
    img = picture(arch, 8)
    req = ChatRequest(
        messages=[
            Message("user", "Open the file."),
            Message("tool", f"Here it is: {IMAGE_MARK}", images=[img], tool_call_id="t1"),
        ],
        max_tokens=6,
        sampling=SamplingParams(temperature=0.0),
    )
    p = lm.prompt(req)
    assert "Here it is:" in p.text and len(p.media.spans) == 1
    with Engine(lm, EngineConfig(num_blocks=64, block_size=4)) as e:
        [(ids, done, _)] = run(e, [req])
        assert done.usage.input_tokens == len(p.ids)
        assert_at_rest(e)
    assert ids
    assert ids == mlx_vlm_greedy(lm, mlx_vlm_model, req)[0]


def test_a_cached_hub_vision_model_loads_by_name(
    model: tuple[str, Any, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vision checkpoint in the local HF cache loads by hub name (offline), as text
    models do, and reads pictures."""
    from mlx_cairn.api.registry import ModelRegistry
    from mlx_cairn.models import hub

    arch, _, folder = model
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.write_cache_entry(hub.cache_dir(), f"org/tiny-{arch}", folder)
    reg = ModelRegistry([f"org/tiny-{arch}"])
    try:
        # Listed as a vision model before it is loaded (from the cached config).
        listed = reg.listing()  # its names, before any load
        assert listed and all(i.vision and not i.loaded for i in listed)
        lease = reg.lease(f"org/tiny-{arch}")
        try:
            assert lease.loaded.takes_images
            [(ids, _, _)] = run(lease.engine, [ask("What is this?", [picture(arch, 9)])])
            assert ids
        finally:
            lease.release()
    finally:
        reg.close()


def test_preempted_and_speculated_rows_keep_their_pictures(
    model: tuple[str, Any, Path], mlx_vlm_model: tuple[Any, Any]
) -> None:
    """A pool too small for four image requests preempts some (they recompute their
    pictures' spans, from the feature cache); n-gram speculation verifies drafts over
    image prompts: every answer is still mlx-vlm's."""
    arch, lm, _ = model
    reqs = [ask("What is this?", [picture(arch, 10 + i)], max_tokens=24) for i in range(4)]
    want = [mlx_vlm_greedy(lm, mlx_vlm_model, r)[0] for r in reqs]
    # Room for about one and a half of the four whole sequences.
    need = max(-(-(len(lm.prompt(r).ids) + len(w)) // 4) for r, w in zip(reqs, want, strict=True))
    blocks = need + need // 2 + 1
    # No decode share: rows run side by side (the share may let one finish first).
    config = EngineConfig(num_blocks=blocks, block_size=4, step_token_budget=16, decode_share=0)
    with Engine(lm, config) as engine:
        got = run(engine, reqs)
        assert engine.stats().preemptions > 0
        assert_at_rest(engine)
    assert [g[0] for g in got] == want
    with Engine(lm, EngineConfig(num_blocks=96, block_size=4, speculative="ngram")) as engine:
        # One at a time: a single stream gets the step's whole draft room. (Whether a
        # row drafts at a step depends on the pipeline's timing: no count is asserted.)
        got = [run(engine, [r])[0] for r in reqs]
        assert_at_rest(engine)
    assert [g[0] for g in got] == want


def test_quantized_kv_blocks(tmp_path: Path) -> None:
    """``--kv-bits 8`` over image prompts (mlx-vlm's attention code handed packed K/V
    blocks): batched answers equal a roomy engine's at the same settings, one request
    at a time."""
    folder = tiny_vision_folder(
        "qwen2_5_vl",
        tmp_path / "q32",
        text={
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        },
    )
    lm = load(str(folder))
    reqs = [ask("What is this?", [picture("qwen2_5_vl", 20 + i)], max_tokens=12) for i in range(3)]
    kv = {"kv_bits": 8, "kv_group_size": 32}
    with Engine(lm, EngineConfig(num_blocks=256, block_size=4, **kv)) as roomy:
        alone = [run(roomy, [r])[0][0] for r in reqs]
        assert_at_rest(roomy)
    with Engine(
        lm, EngineConfig(num_blocks=64, block_size=4, step_token_budget=16, **kv)
    ) as engine:
        got = [g[0] for g in run(engine, reqs)]
        assert_at_rest(engine)
    assert got == alone
    assert all(ids for ids in got)
