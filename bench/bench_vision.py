"""Pictures on the engine vs mlx-vlm's own generation, side by side in one run (issue 34).

One random-weight Qwen2.5-VL checkpoint (written with mlx-vlm's classes; larger
than the test models: a 6-layer 512-wide language model, a 4-block vision
tower, 448 x 448 pictures = 256 image tokens each) serves both sides:

- TTFT of an agent's next turn: turn 1 is a conversation with a picture;
  turn 2 re-sends it, its answer and a new question. Cold: turn 2 on a fresh
  engine (the vision tower runs, the whole prompt is prefilled). Warm: turn 2
  right after turn 1 (the prefix cache holds the picture's KV; only the tokens
  after turn 1's prompt are computed). mlx-vlm's ``generate_step`` keeps no
  cache across calls: its turn 2 is always cold.
- 4 requests with 4 pictures: our engine batches them (submitted together);
  mlx-vlm serves them one after another. Aggregate output tokens/s of each.

Greedy everywhere, so both sides generate the same tokens. Run::

    .venv/bin/python bench/bench_vision.py            # about a minute on 2 cores
    .venv/bin/python bench/bench_vision.py --trials 5 --max-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image as PILImage

import mlx_cairn  # noqa: F401  (optimized BLAS first)
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.models import load
from mlx_cairn.testing.tiny_vision import tiny_vision_folder
from mlx_cairn.types import IMAGE_MARK, ChatRequest, Done, Image, Message, SamplingParams

SIDE = 448
SENTENCE = "You are a careful assistant that describes screenshots for a coding agent. "
#: Sentences of system prompt (``--system``; an agent's system prompt and tools are
#: thousands of tokens, re-sent every turn).
SYSTEM = {"short": 4, "agent": 30}


def build(folder: Path) -> Path:
    return tiny_vision_folder(
        "qwen2_5_vl",
        folder,
        text={
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": 8192,
            "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
        },
        vision={
            "depth": 4,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_heads": 4,
            "out_hidden_size": 512,
            "window_size": 112,
            "fullatt_block_indexes": [3],
        },
        preprocessor={"min_pixels": SIDE * SIDE, "max_pixels": SIDE * SIDE},
    )


def picture(seed: int) -> Image:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    return Image.from_pil(PILImage.fromarray(pixels))


#: Session names (words: the tiny tokenizer splits digits unlike transformers' copy of it).
NAMES = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
]


def turn1(i: int, img: Image, max_tokens: int, system: int = 4) -> ChatRequest:
    name = NAMES[i % len(NAMES)] + " " + NAMES[i // len(NAMES) % len(NAMES)]
    return ChatRequest(
        messages=[
            Message("system", f"Session {name}. {SENTENCE * system}"),
            Message("user", f"{IMAGE_MARK}What does this screenshot show?", images=[img]),
        ],
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
    )


def turn2(first: ChatRequest, answer: str, max_tokens: int) -> ChatRequest:
    return ChatRequest(
        messages=[
            *first.messages,
            Message("assistant", answer),
            Message("user", "Which button should I press next?"),
        ],
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
    )


def ours(engine: Engine, reqs: list[ChatRequest]) -> tuple[list[Done], list[list[int]], float]:
    t0 = time.perf_counter()
    streams = [engine.submit(r) for r in reqs]
    dones = []
    for s in streams:
        done = list(s.iter_sync(timeout=600.0))[-1]
        assert isinstance(done, Done), done
        dones.append(done)
    return dones, [list(s.output_ids) for s in streams], time.perf_counter() - t0


def theirs(lm: Any, vlm: Any, req: ChatRequest) -> tuple[float, list[int], float]:
    """mlx-vlm's generate_step on our rendered prompt: (TTFT s, tokens, total s), with
    its own attention (ours is patched into its modules process-wide)."""
    from mlx_cairn.backends.cpu import attention as cpu_attention

    with cpu_attention.disabled():
        return _theirs(lm, vlm, req)


def _theirs(lm: Any, vlm: Any, req: ChatRequest) -> tuple[float, list[int], float]:
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import prepare_inputs

    model, processor = vlm
    t0 = time.perf_counter()
    prompt = lm.prompt(req)
    pics = [im.pixels for m in req.messages for im in m.images]
    inputs = prepare_inputs(processor, images=pics, prompts=prompt.text)
    assert inputs["input_ids"][0].tolist() == prompt.ids, "the two sides see different prompts"
    extra = {
        k: v
        for k, v in inputs.items()
        if k not in ("input_ids", "pixel_values", "attention_mask") and v is not None
    }
    out: list[int] = []
    ttft = 0.0
    for tok, _ in generate_step(
        inputs["input_ids"],
        model,
        inputs["pixel_values"],
        inputs["attention_mask"],
        max_tokens=req.max_tokens,
        temperature=0.0,
        **extra,
    ):
        if not out:
            ttft = time.perf_counter() - t0
        out.append(int(tok))
        if tok in lm.eos_token_ids:
            break
    mx.eval(mx.array(0))
    return ttft, out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument(
        "--max-tokens", type=int, default=128, help="answer tokens of the measured turns"
    )
    ap.add_argument(
        "--answer-tokens", type=int, default=16, help="turn 1's answer (history of turn 2)"
    )
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--system", choices=list(SYSTEM), default="short", help="system prompt length")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "qwen2_5_vl-bench")
        lm = load(str(folder))
        from mlx_vlm.utils import load as vlm_load

        vlm = vlm_load(str(folder))
        n_img = len(lm.prompt(turn1(0, picture(0), 1)).media.spans[0].ids)
        print(f"model: {folder.name}, {SIDE}x{SIDE} pictures = {n_img} image tokens")

        def fresh() -> Engine:
            lm.vision._features.clear()  # cold: the vision tower runs again
            lm.vision._processed.clear()
            return Engine(lm, EngineConfig(num_blocks=1024, block_size=16))

        with fresh() as engine:
            ours(engine, [turn1(50, picture(999), 4)])  # warm-up (graph building, caches)
        theirs(lm, vlm, turn1(51, picture(998), 4))
        cold, warm, peer, hits = [], [], [], []
        for i in range(args.trials):
            first = turn1(i, picture(i), args.answer_tokens, SYSTEM[args.system])
            with fresh() as engine:
                [_], [ids1], _ = ours(engine, [first])
            second = turn2(first, lm.tokenizer.decode(ids1), args.max_tokens)
            with fresh() as engine:  # the second turn's prompt, nothing cached
                [d], _, _ = ours(engine, [second])
                cold.append(d.timings.ttft_ms / 1e3)
            with fresh() as engine:  # after the first turn: its picture and KV are cached
                ours(engine, [first])
                [d], _, _ = ours(engine, [second])
                warm.append(d.timings.ttft_ms / 1e3)
                hits.append((d.usage.cached_tokens, d.usage.input_tokens))
            peer.append(theirs(lm, vlm, second)[0])
        c, w, pc = statistics.median(cold), statistics.median(warm), statistics.median(peer)
        print(f"turn 2 TTFT, nothing cached:  ours {c * 1e3:7.1f} ms   mlx-vlm {pc * 1e3:7.1f} ms")
        print(f"turn 2 TTFT, turn 1 cached:   ours {w * 1e3:7.1f} ms   (warm / cold {w / c:.3f})")
        print(f"  cached / input tokens of the warm turn 2: {hits}")

        with Engine(lm, EngineConfig(num_blocks=1024, block_size=16)) as engine:
            imgs = [picture(100 + i) for i in range(args.concurrent)]
            reqs = [turn1(100 + i, im, args.max_tokens) for i, im in enumerate(imgs)]
            _, outs, wall = ours(engine, reqs)
            ours_tps = sum(len(o) for o in outs) / wall
        t0 = time.perf_counter()
        peer_outs = [theirs(lm, vlm, r)[1] for r in reqs]
        peer_wall = time.perf_counter() - t0
        peer_tps = sum(len(o) for o in peer_outs) / peer_wall
        same = outs == peer_outs
        print(
            f"{args.concurrent} image requests: ours {ours_tps:6.1f} tok/s ({wall:.2f} s, batched)"
            f"   mlx-vlm {peer_tps:6.1f} tok/s ({peer_wall:.2f} s, one after another)"
            f"   ratio {ours_tps / peer_tps:.2f}x   same tokens: {same}"
        )


if __name__ == "__main__":
    main()
