"""Speculative decoding inside continuous batching: proposals, adaptive K, exact verification.

A speculating row proposes up to K draft tokens after its last known token
and feeds them with it in one verify row of the step (``RowPlan.draft``)::

    fed:      t(L-1)  d1  d2 ... dk          (positions L-1 .. L-1+k)
    logits:   p0      p1  p2 ... pk          (p_i scores the token after the i-th fed one)
    accept:   d1 if p0 agrees, then d2 if p1 agrees, ... (a = the leading run)
    output:   d1 .. da, then one token from p_a (the correction, or a bonus
              token when every draft was accepted)

Every position is sampled exactly as without speculation (greedy rows take
the argmax, sampled rows draw with their seed at that output index), and
``d_i`` is accepted when it is the token drawn there. So a row's output is
token for token its output without speculation, whatever was drafted and
whatever else is batched (up to the logits' float rounding). For a draft
that puts all its mass on one token this accepts with probability p(d_i),
as speculative sampling's accept-or-resample does, whose output would
instead depend on the drafts (tests check the distribution on a small
vocabulary).
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

from mlx_cairn.engine.sampler import sample_rows
from mlx_cairn.types import SamplingParams

#: Longest and shortest n-gram the prompt lookup matches.
NGRAM_MAX = 24
NGRAM_MIN = 2
#: Pause (tokens) after a row's proposals stop paying, doubled each time, up to the cap.
PAUSE_TOKENS = 16
PAUSE_MAX_TOKENS = 512
#: A draft slot a draft model fills in before the step runs (engine/draft.py).
DRAFT_SLOT = -1


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
    rows_logits = logits[mx.array(idx)]  # [R, W, V]
    # Each position drawn as a plain decode step at that output index would draw it.
    drawn = sample_rows(
        rows_logits.reshape(R * width, -1),
        [r.sampling for r in rows for _ in range(width)],
        [r.out_index + i for r in rows for i in range(width)],
    ).reshape(R, width)
    accept = (drawn == mx.array(target)) & mx.array(target >= 0)
    counts = mx.cumprod(accept.astype(mx.int32), axis=1).sum(axis=1)
    # Accepted positions drew their draft: the drawn tokens are the output.
    return drawn, counts
