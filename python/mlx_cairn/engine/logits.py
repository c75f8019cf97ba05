"""Per-row logits processing before sampling, and the log-probabilities clients ask for.

A step's sampling rows share one logits matrix [B, V]. Each processor kind
runs as one batched MLX op over the rows that use it, and costs nothing for
the rows that do not::

    logits [B, V] ─► penalties (rows with repetition / frequency / presence)
                 ─► bias       (rows with logit_bias, and row masks such as a grammar's)
                 ─► sampler    (temperature, top_k, top_p, min_p)

The penalties read the row's token counts. They live on the device and are
kept as a cache of the row's *known* tokens (extended when new tokens are read
back), plus its tokens still in flight, which are lazy arrays: a row with
penalties keeps the one-step look-ahead. A processor that needs the previous
token on the host (a grammar matcher) says so with ``needs_host_token`` and
its row is scheduled only once nothing of it is in flight.

Example::

    procs = RowProcessors.for_sequence(seq, vocab)     # None when the row uses none
    logits = process([seq_a, seq_b], logits)           # rows in logits order
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

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
        "bias",
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
        self.bias: mx.array | None = None
        if s.logit_bias:
            ids = mx.array(list(s.logit_bias), dtype=mx.int32)
            vals = mx.array(list(s.logit_bias.values()), dtype=mx.float32)
            self.bias = mx.zeros((vocab,), dtype=mx.float32).at[ids].add(vals)
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

    @property
    def needs_host_token(self) -> bool:
        return any(m.needs_host_token for m in self.extra)

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


def process(rows: list[Sequence], logits: mx.array) -> mx.array:
    """Apply every row's processors to ``logits`` [B, V] (rows in order); a no-op when none."""
    vocab = int(logits.shape[-1])
    procs = [RowProcessors.for_sequence(s, vocab) for s in rows]
    if all(p is None for p in procs):
        return logits
    logits = logits.astype(mx.float32)
    pen = [i for i, p in enumerate(procs) if p is not None and p.penalized]
    if pen:
        idx = mx.array(pen, dtype=mx.int32)
        counts = mx.stack([procs[i].output_counts(rows[i]) for i in pen])  # type: ignore[union-attr]
        sub = logits[idx]
        rep = [procs[i].repetition for i in pen]  # type: ignore[union-attr]
        if any(r != 1.0 for r in rep):
            seen = counts > 0
            prompt = [procs[i].prompt_seen for i in pen]  # type: ignore[union-attr]
            none = mx.zeros((vocab,), dtype=mx.bool_)
            seen = seen | mx.stack([p if p is not None else none for p in prompt])
            r = mx.array(rep, dtype=mx.float32)[:, None]
            sub = mx.where(seen, mx.where(sub > 0, sub / r, sub * r), sub)
        freq = mx.array([procs[i].frequency for i in pen], dtype=mx.float32)[:, None]  # type: ignore[union-attr]
        pres = mx.array([procs[i].presence for i in pen], dtype=mx.float32)[:, None]  # type: ignore[union-attr]
        sub = sub - freq * counts - pres * (counts > 0).astype(mx.float32)
        logits[idx] = sub
    adds: list[tuple[int, mx.array]] = []
    for i, p in enumerate(procs):
        if p is None:
            continue
        parts = [m for m in (m.mask(rows[i], vocab) for m in p.extra) if m is not None]
        if p.bias is not None:
            parts.append(p.bias)
        if parts:
            total = parts[0]
            for m in parts[1:]:
                total = total + m
            adds.append((i, total))
    if adds:
        idx = mx.array([i for i, _ in adds], dtype=mx.int32)
        logits[idx] = logits[idx] + mx.stack([m for _, m in adds])
    return logits


def needs_host_token(seq: Sequence) -> bool:
    """Whether ``seq`` may only be scheduled once its last token is on the host."""
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
