"""Per-row logits processing before sampling, and the log-probabilities clients ask for.

A step's sampling rows share one logits matrix [B, V]. Each processor kind
runs as one batched MLX op over the rows that use it, and costs nothing for
the rows that do not::

    logits [B, V] ─► penalties (rows with repetition / frequency / presence)
                 ─► bias       (rows with logit_bias: a sparse add)
                 ─► row masks  (additive [V] masks, such as a grammar's)
                 ─► sampler    (temperature, top_k, top_p, min_p)

The penalties read the row's token counts. They live on the device and are
kept as a cache of the row's *known* tokens (extended when new tokens are read
back), plus its tokens still in flight, which are lazy arrays: a row with
penalties keeps the one-step look-ahead. A processor that needs the previous
token on the host (a grammar matcher) says so with ``needs_host_token``: its
row's forward pass still runs ahead on the placeholder token, and only its
sampling waits until that token has been read back (``runner.sample_deferred``).

Example::

    procs = RowProcessors.for_sequence(seq, vocab)     # None when the row uses none
    logits = process([seq_a, seq_b], logits)           # rows in logits order
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from mlx_cairn.engine.sequence import Sequence


class RowMask(Protocol):
    """An extra per-row processor (the grammar seam): an additive [V] mask per step."""

    #: True when ``mask`` needs every sampled token on the host first.
    needs_host_token: bool

    def mask(self, seq: Sequence, vocab: int) -> mx.array | None:
        """Additive fp32 mask [V] for ``seq``'s next token (None: no constraint)."""
        ...


class RowProcessors:
    """The processors of one sequence and their device-side caches."""

    __slots__ = (
        "_counted",
        "_counts",
        "bias_ids",
        "bias_values",
        "extra",
        "frequency",
        "presence",
        "prompt_seen",
        "repetition",
        "vocab",
    )

    def __init__(self, seq: Sequence, vocab: int) -> None:
        s = seq.prepared.sampling
        self.vocab = vocab
        self.repetition = float(s.repetition_penalty)
        self.frequency = float(s.frequency_penalty)
        self.presence = float(s.presence_penalty)
        #: logit_bias as (token ids, values), applied as a sparse add.
        self.bias_ids: np.ndarray | None = None
        self.bias_values: np.ndarray | None = None
        if s.logit_bias:
            self.bias_ids = np.fromiter(s.logit_bias, dtype=np.int32)
            self.bias_values = np.fromiter(s.logit_bias.values(), dtype=np.float32)
        self.prompt_seen: mx.array | None = None
        if self.repetition != 1.0:
            self.prompt_seen = _histogram(seq.tokens[: seq.num_prompt], vocab) > 0
        self.extra: list[RowMask] = []
        # Counts of the output tokens known so far, and how many they cover.
        self._counts = mx.zeros((vocab,), dtype=mx.float32)
        self._counted = 0

    @staticmethod
    def for_sequence(seq: Sequence, vocab: int) -> RowProcessors | None:
        if seq.processors is None and (seq.prepared.sampling.uses_processors or seq.row_masks):
            seq.processors = RowProcessors(seq, vocab)
            seq.processors.extra = list(seq.row_masks)
        return seq.processors

    @property
    def penalized(self) -> bool:
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0

    def output_counts(self, seq: Sequence) -> mx.array:
        """[V] counts of every output token, those in flight included (lazy)."""
        known = seq.tokens[seq.num_prompt :]
        if len(known) < self._counted:  # tokens were replaced: count again
            self._counts, self._counted = mx.zeros((self.vocab,), dtype=mx.float32), 0
        if len(known) > self._counted:
            self._counts = self._counts + _histogram(known[self._counted :], self.vocab)
            self._counted = len(known)
        counts = self._counts
        if seq.inflight:
            lazy = mx.stack([t.reshape(()) for t in seq.inflight]).astype(mx.int32)
            counts = counts.at[lazy].add(1.0)
        return counts


def process(
    rows: list[Sequence], logits: mx.array, masks: list[list[mx.array]] | None = None
) -> mx.array:
    """``logits`` [B, V] with every row's processors applied (rows in order).

    A new array: the raw logits stay as they were (logprobs read them). Each
    kind runs once over the whole batch with neutral values for the rows that
    do not use it, and is skipped when no row does; on this machine's CPU one
    full [B, V] elementwise op costs about as much as a gather-and-scatter of
    the rows, and it keeps the graph small.
    """
    vocab = int(logits.shape[-1])
    procs = [RowProcessors.for_sequence(s, vocab) for s in rows]
    if all(p is None for p in procs):
        return logits
    out = logits.astype(mx.float32)
    pen = [p if p is not None and p.penalized else None for p in procs]
    if any(p is not None for p in pen):
        zero = mx.zeros((vocab,), dtype=mx.float32)
        counts = mx.stack(
            [p.output_counts(s) if p is not None else zero for p, s in zip(pen, rows, strict=True)]
        )
        rep = [p.repetition if p is not None else 1.0 for p in pen]
        if any(r != 1.0 for r in rep):
            none = mx.zeros((vocab,), dtype=mx.bool_)
            seen = (counts > 0) | mx.stack(
                [
                    p.prompt_seen if p is not None and p.prompt_seen is not None else none
                    for p in pen
                ]
            )
            r = mx.array(rep, dtype=mx.float32)[:, None]
            out = out * mx.where(seen, mx.where(out > 0, 1.0 / r, r), 1.0)
        freq = [p.frequency if p is not None else 0.0 for p in pen]
        if any(f != 0.0 for f in freq):
            out = out - mx.array(freq, dtype=mx.float32)[:, None] * counts
        pres = [p.presence if p is not None else 0.0 for p in pen]
        if any(v != 0.0 for v in pres):
            out = out - mx.array(pres, dtype=mx.float32)[:, None] * (counts > 0)
    bias = [
        (b, p.bias_ids, p.bias_values)
        for b, p in enumerate(procs)
        if p is not None and p.bias_ids is not None
    ]
    if bias:
        r_idx = mx.array(np.concatenate([np.full(len(ids), b, np.int32) for b, ids, _ in bias]))
        c_idx = mx.array(np.concatenate([ids for _, ids, _ in bias]))
        vals = mx.array(np.concatenate([v for _, _, v in bias]))
        out = out.at[r_idx, c_idx].add(vals)
    if masks is None:
        masks = [row_masks(rows[b], p, vocab) for b, p in enumerate(procs)]
    if any(masks):
        zero = mx.zeros((vocab,), dtype=mx.float32)
        stacked = []
        for ms in masks:
            total = ms[0] if ms else zero
            for m in ms[1:]:
                total = total + m
            stacked.append(total)
        out = out + mx.stack(stacked)
    return out


def row_masks(seq: Sequence, procs: RowProcessors | None, vocab: int) -> list[mx.array]:
    """The additive masks of ``seq``'s row masks for its next token."""
    if procs is None:
        return []
    return [m for m in (x.mask(seq, vocab) for x in procs.extra) if m is not None]


def masks_for(seq: Sequence, vocab: int) -> list[mx.array]:
    """``seq``'s row masks for its next token (its processors are created if needed)."""
    return row_masks(seq, RowProcessors.for_sequence(seq, vocab), vocab)


def needs_host_token(seq: Sequence) -> bool:
    """Whether ``seq``'s sampling must wait until its last token is on the host."""
    return any(m.needs_host_token for m in seq.row_masks)


# ---------------------------------------------------------------- logprobs


class StepLogprobs:
    """Lazy log-probabilities of one step's rows that asked for them.

    ``rows`` index the step's sampling rows; ``chosen`` [R], ``top_ids`` /
    ``top_values`` [R, K] (K = the largest ``top_logprobs`` asked, sorted
    descending).
    """

    __slots__ = ("chosen", "rows", "top_ids", "top_values")

    def __init__(self, rows: list[int], chosen: mx.array, top_ids: Any, top_values: Any) -> None:
        self.rows = rows
        self.chosen = chosen
        self.top_ids = top_ids
        self.top_values = top_values

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_values) if a is not None]

    def read(self) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """{row: (chosen logprob, [(token id, logprob), ...])} on the host."""
        chosen: list[float] = self.chosen.tolist()  # type: ignore[assignment]
        ids: list[list[int]] = self.top_ids.tolist() if self.top_ids is not None else []
        vals: list[list[float]] = self.top_values.tolist() if self.top_values is not None else []
        out = {}
        for j, row in enumerate(self.rows):
            top = list(zip(ids[j], vals[j], strict=True)) if ids else []
            out[row] = (chosen[j], top)
        return out


def step_logprobs(rows: list[Sequence], raw: mx.array, sampled: mx.array) -> StepLogprobs | None:
    """Log-probabilities under the raw logits ``raw`` [B, V] of the rows that want them."""
    want = [i for i, s in enumerate(rows) if s.prepared.sampling.logprobs]
    if not want:
        return None
    idx = mx.array(want, dtype=mx.int32)
    sub = raw[idx].astype(mx.float32)
    lp = sub - mx.logsumexp(sub, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, sampled[idx].astype(mx.int32)[:, None], axis=-1)[:, 0]
    k = max(rows[i].prepared.sampling.top_logprobs for i in want)
    top_ids = top_values = None
    if k > 0:
        k = min(k, int(lp.shape[-1]))
        part = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(lp, part, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        top_ids = mx.take_along_axis(part, order, axis=-1)
        top_values = mx.take_along_axis(vals, order, axis=-1)
    return StepLogprobs(want, chosen, top_ids, top_values)


def _histogram(ids: list[int], vocab: int) -> mx.array:
    if not ids:
        return mx.zeros((vocab,), dtype=mx.float32)
    return mx.zeros((vocab,), dtype=mx.float32).at[mx.array(ids, dtype=mx.int32)].add(1.0)
