"""Speculative decoding inside continuous batching: proposals, adaptive K, exact verification.

A speculating row proposes up to K draft tokens after its last known token
and feeds them with it in one verify row of the step (``RowPlan.draft``)::

    fed:      t(L-1)  d1  d2 ... dk          (positions L-1 .. L-1+k)
    logits:   p0      p1  p2 ... pk          (p_i scores the token after the i-th fed one)
    accept:   d1 if p0 agrees, then d2 if p1 agrees, ... (a = the leading run)
    output:   d1 .. da, then one token from p_a (the correction, or a bonus
              token when every draft was accepted)

Greedy rows accept ``d_i`` exactly when it is p_(i-1)'s argmax, so their
output is token for token the output without speculation. Sampled rows use
speculative sampling for a proposal that puts all its mass on ``d_i``: accept
with probability p(d_i), else sample from p with ``d_i`` removed; the output
keeps the model's distribution (tests check it on a small vocabulary).
Rejected positions roll back: ``num_computed`` stops after the accepted ones,
their KV rows are rewritten by later steps, their surplus blocks are freed and
never registered in the prefix cache (engine/update.py).

Proposers: prompt lookup (:class:`NgramProposer`: the continuation that followed
the latest earlier occurrence of the row's last tokens, in prompt and output).
:class:`RowSpec` adapts K to the row's recent acceptance, down to a pause when
nothing is accepted, so text with no repetition costs (almost) nothing.

A row speculates only when its next token is known on the host, so verify rows
give up the engine's one-step look-ahead; the engine reads the step in flight
back first when a speculating row needs it (``Scheduler.wants_sync``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_cairn.engine.sampler import filtered_probs, row_uniform
from mlx_cairn.types import GREEDY_BELOW_TEMPERATURE, SamplingParams

#: Longest and shortest n-gram the prompt lookup matches.
NGRAM_MAX = 24
NGRAM_MIN = 2
#: Pause (tokens) after a row's proposals stop paying, doubled each time, up to the cap.
PAUSE_TOKENS = 16
PAUSE_MAX_TOKENS = 512
#: A draft slot a draft model fills in before the step runs (engine/draft.py).
DRAFT_SLOT = -1
#: The accept draws use a stream apart from the sampler's (keyed by the same seed).
_ACCEPT_STREAM = 0x5EC0_11A7_E000_0001


class NgramProposer:
    """Prompt lookup over a row's tokens (prompt and known output).

    The tokens live in a growing int32 buffer; a lookup scans it with numpy for
    the earlier positions that end like the row does (longest n-gram first,
    from :data:`NGRAM_MAX` down to :data:`NGRAM_MIN`), picks the latest, and
    proposes the tokens that followed it.
    """

    __slots__ = ("_buf", "_len")

    def __init__(self) -> None:
        self._buf = np.zeros(256, dtype=np.int32)
        self._len = 0

    def _sync(self, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        if n < self._len:  # tokens were replaced (never in practice): start again
            self._len = 0
        if n > self._buf.size:
            buf = np.zeros(max(n, 2 * self._buf.size), dtype=np.int32)
            buf[: self._len] = self._buf[: self._len]
            self._buf = buf
        if n > self._len:
            self._buf[self._len : n] = tokens[self._len : n]
            self._len = n
        return self._buf[:n]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of ``tokens``' end."""
        if k <= 0:
            return []
        arr = self._sync(tokens)
        n = arr.size
        if n < NGRAM_MIN + 1:
            return []
        # Candidate ends c (c < n - 1): arr[c] == the last token, and a continuation exists.
        cands = np.flatnonzero(arr[: n - 1] == arr[n - 1])
        if cands.size == 0:
            return []
        matched = np.ones(cands.size, dtype=np.int32)
        alive = np.ones(cands.size, dtype=bool)
        for j in range(1, NGRAM_MAX):
            if n - 1 - j < 0:
                break
            prev = cands - j
            ok = alive & (prev >= 0)
            ok[ok] = arr[prev[ok]] == arr[n - 1 - j]
            matched += ok
            alive = ok
            if not alive.any():
                break
        best = int(matched.max())
        if best < NGRAM_MIN:
            return []
        c = int(cands[np.flatnonzero(matched == best)[-1]])
        return [int(t) for t in arr[c + 1 : min(c + 1 + k, n)]]


class RowSpec:
    """A sequence's speculation: its proposer, adaptive K, and its counters.

    With ``by_model`` a draft model proposes (engine/draft.py): :meth:`propose`
    gives K :data:`DRAFT_SLOT` placeholders, filled in before the step runs, and
    ``draft_computed`` counts the leading positions whose draft KV is right.

    K starts at ``k_max``; after a verify it becomes one more than what was
    accepted (so a long accepted run keeps K up, a miss brings it down fast).
    Two verifies in a row with nothing accepted pause proposals for
    :data:`PAUSE_TOKENS` tokens (doubling each time, up to
    :data:`PAUSE_MAX_TOKENS`); an accepted run resets the pause.
    """

    __slots__ = (
        "_misses",
        "_pause",
        "_pause_len",
        "accepted",
        "draft_computed",
        "k",
        "k_max",
        "proposed",
        "proposer",
        "verifies",
        "wants",
    )

    def __init__(self, k_max: int, *, by_model: bool = False) -> None:
        self.k_max = k_max
        self.k = k_max
        self.proposer = None if by_model else NgramProposer()
        #: Positions of the draft model's KV that hold the right tokens (the
        #: scheduler lowers it to a prefix hit at admission).
        self.draft_computed = 1 << 62
        self.proposed = 0
        self.accepted = 0
        self.verifies = 0
        #: The row's end matched something at its last look (the engine then
        #: reads the step in flight back first, so the row can propose).
        self.wants = True
        self._misses = 0
        self._pause = 0
        self._pause_len = PAUSE_TOKENS

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """The draft for the token after ``tokens`` (at most ``limit`` tokens; may be empty)."""
        if self._pause > 0:
            return []
        if self.proposer is None:
            return [DRAFT_SLOT] * min(self.k, limit)
        draft = self.proposer.propose(tokens, min(self.k, limit))
        self.wants = bool(draft)
        return draft

    def observe(self, tokens: list[int], produced: int) -> None:
        """``produced`` new tokens joined the row: count down a pause; see whether the
        row's end matches (so the next step proposes)."""
        if self._pause > 0:
            self._pause = max(0, self._pause - produced)
            self.wants = False
            if self._pause > 0:
                return
        self.wants = self.proposer is None or bool(self.proposer.propose(tokens, 1))

    def record(self, proposed: int, accepted: int) -> None:
        """A verify of ``proposed`` draft tokens accepted ``accepted`` of them."""
        self.proposed += proposed
        self.accepted += accepted
        self.verifies += 1
        self.k = max(1, min(self.k_max, accepted + 1 if accepted < proposed else self.k_max))
        if accepted:
            self._misses = 0
            self._pause_len = PAUSE_TOKENS
            return
        self._misses += 1
        if self._misses >= 2:
            self._misses = 0
            self._pause = self._pause_len
            self._pause_len = min(PAUSE_MAX_TOKENS, 2 * self._pause_len)
            self.wants = False


@dataclass(frozen=True, slots=True)
class VerifyRow:
    """One verify row for :func:`verify`: its logits start at ``offset`` of the step's
    verify logits, one per fed token (``1 + len(draft)``)."""

    offset: int
    draft: tuple[int, ...]
    sampling: SamplingParams
    #: Output index of the first token this row produces (keys its draws).
    out_index: int


def verify(logits: mx.array, rows: list[VerifyRow]) -> tuple[mx.array, mx.array]:
    """Verify every row's draft in one graph (lazy).

    ``logits`` [N, V] are the raw logits of all verify rows' fed tokens. Returns
    ``tokens`` [R, W] (W = 1 + the longest draft) and ``counts`` [R]: row r's output
    is ``tokens[r, : counts[r] + 1]`` (its accepted drafts, then one more token).
    """
    width = 1 + max(len(r.draft) for r in rows)
    R = len(rows)
    idx = np.zeros((R, width), dtype=np.int32)
    target = np.full((R, width), -1, dtype=np.int32)
    for b, r in enumerate(rows):
        k = len(r.draft)
        idx[b] = r.offset + np.minimum(np.arange(width), k)
        target[b, :k] = r.draft
    tgt = mx.array(target)
    rows_logits = logits[mx.array(idx)]  # [R, W, V]
    greedy = mx.argmax(rows_logits, axis=-1).astype(mx.int32)
    sampled_rows = [
        b for b, r in enumerate(rows) if r.sampling.temperature >= GREEDY_BELOW_TEMPERATURE
    ]
    accept = greedy == tgt
    cand = greedy
    if sampled_rows:
        s_accept, s_cand = _speculative_sample(rows_logits, rows, target, width)
        is_sampled = np.zeros((R, 1), dtype=bool)
        is_sampled[sampled_rows] = True
        pick = mx.array(is_sampled)
        accept = mx.where(pick, s_accept, accept)
        cand = mx.where(pick, s_cand, cand)
    accept = accept & (tgt >= 0)
    counts = mx.cumprod(accept.astype(mx.int32), axis=1).sum(axis=1)
    pos = mx.arange(width, dtype=mx.int32)[None, :]
    tokens = mx.where(pos < counts[:, None], tgt, cand)
    return tokens, counts


def _speculative_sample(
    rows_logits: mx.array, rows: list[VerifyRow], target: np.ndarray, width: int
) -> tuple[mx.array, mx.array]:
    """Accept flags and correction samples [R, W] for sampled rows (greedy rows get
    values that :func:`verify` ignores)."""
    R, _, V = rows_logits.shape
    params = [r.sampling for r in rows for _ in range(width)]
    probs = filtered_probs(rows_logits.reshape(R * width, V), params).reshape(R, width, V)
    u_accept = np.ones((R, width), dtype=np.float32)
    u_sample = np.ones((R, width), dtype=np.float32)
    for b, r in enumerate(rows):
        if r.sampling.temperature < GREEDY_BELOW_TEMPERATURE:
            continue
        seed = r.sampling.seed
        assert seed is not None, "a sampled row needs a seed"
        for i in range(1 + len(r.draft)):
            u_sample[b, i] = row_uniform(seed, r.out_index + i)
            u_accept[b, i] = row_uniform(seed ^ _ACCEPT_STREAM, r.out_index + i)
    tgt = mx.array(np.maximum(target, 0))
    p_draft = mx.take_along_axis(probs, tgt[..., None], axis=-1)[..., 0]
    accept = mx.array(u_accept) < p_draft
    # The correction: p without the rejected draft token (where there was one).
    drop = (mx.arange(V, dtype=mx.int32)[None, None, :] == tgt[..., None]) & mx.array(target >= 0)[
        ..., None
    ]
    residual = mx.where(drop, 0.0, probs)
    cdf = mx.cumsum(residual, axis=-1)
    goal = mx.array(u_sample)[..., None] * cdf[..., -1:]
    cand = mx.minimum((cdf < goal).sum(axis=-1), V - 1).astype(mx.int32)
    return accept, cand
