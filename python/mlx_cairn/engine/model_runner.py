"""Runs planned steps on MLX: batched decode, chunked prefill, sampling, pipelined.

One step is built as a single lazy MLX graph and queued with ``mx.async_eval``::

    decode rows  (B x 1 tokens, ragged contexts)   -> logits [B, vocab]
    + verify rows (1 + draft tokens each, in the    -> logits at every fed token,
      same call, decode rows padded)                  speculate.verify -> tokens
    prefill chunk per sequence (1 x n tokens)      -> logits [1, vocab] if it is the
                                                      sequence's last pending chunk
    logits processors (penalties, bias, masks)     -> logits [R, vocab], R sampling rows
    sample(logits, per-row settings)               -> one token per sampling row
    log-probabilities of the raw logits            -> for the rows that ask
    async_eval(tokens, logprobs, every pool array)

The runner reads the plan and the sequences' tokens and writes no request
state: the engine's update step commits what a launched step computed.
The engine launches step n+1 (whose decode inputs are step n's still-lazy
tokens, the plan's placeholders) before reading step n's tokens back, so
building the next graph in Python overlaps the forward pass on the device::

    execute(1)  execute(2) read(1)  execute(3) read(2)  ...

On the CPU, where ``mx.async_eval`` returns only once nearly all of a step
has run, that order would hand every token out a step late; there the engine
builds step n+1 under :meth:`ModelRunner.hold`, reads step n back (its last
few ops overlap the building), and only then queues step n+1::

    build(2) read(1) queue(2)  build(3) read(2) queue(3)  ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_cairn.engine import logits as _logits
from mlx_cairn.engine import speculate
from mlx_cairn.engine.paged import KVPools, PagedKVCache
from mlx_cairn.engine.plan import RowPlan, StepPlan
from mlx_cairn.engine.sampler import sample_rows

#: A prefill chunk of at least this many tokens runs in a forward call of its own
#: (runner._prefill_groups): batching it saves little and padding costs a lot.
SOLO_PREFILL_TOKENS = 128


@dataclass(slots=True)
class StepOutput:
    """What a launched step will sample: lazy until read back.

    ``rows`` are the plan's sampling rows, in the order of ``sampled``.
    """

    plan: StepPlan
    rows: tuple[RowPlan, ...]
    sampled: mx.array | None
    #: (offset of its first row in ``rows``, lazy logprobs) per launched part.
    logprobs: list[tuple[int, _logits.StepLogprobs]] = field(default_factory=list)
    #: Sampling rows whose processors need their last token on the host, which
    #: is still in flight: their forward pass is queued, their sampling waits
    #: for :meth:`ModelRunner.sample_deferred` (after that token is read back).
    deferred: tuple[RowPlan, ...] = ()
    #: Their raw logits [len(deferred), vocab] (lazy).
    deferred_logits: mx.array | None = None
    #: Verify rows (speculative decoding) per launched part: (rows, tokens [R, W],
    #: counts [R]) from :func:`mlx_cairn.engine.speculate.verify` (lazy).
    verify: list[tuple[tuple[RowPlan, ...], mx.array, mx.array]] = field(default_factory=list)


@dataclass(slots=True)
class SampledStep:
    """A step's output on the host: one token per sampling row (and logprobs)."""

    plan: StepPlan
    rows: tuple[RowPlan, ...]
    tokens: list[int]
    #: {row index: (chosen logprob, [(token id, logprob), ...])}
    logprobs: dict[int, tuple[float, list[tuple[int, float]]]]
    #: Verify rows and their output tokens (accepted drafts, then one more), or
    #: why that row could not be read.
    verified: list[tuple[RowPlan, list[int] | BaseException]] = field(default_factory=list)


class ModelRunner:
    """Owns the forward calls of the engine thread. Reads sequences, writes none."""

    def __init__(self, model: Any, pools: KVPools) -> None:
        self.model = model
        self.pools = pools
        self._takes_images = bool(getattr(model, "takes_images", False))
        #: What :meth:`_queue` was given between :meth:`hold` and :meth:`release`.
        self._held: list[mx.array] | None = None

    #: How long an idle engine thread waits before calling :meth:`idle` (None: until
    #: woken; a distributed runner sends its heartbeat there).
    idle_s: float | None = None

    def idle(self) -> None:
        """Called on the idle engine thread every :attr:`idle_s` seconds."""

    def copy_rows(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Partial-block prefix copies (:meth:`KVPools.copy_rows`), before a step's calls."""
        self.pools.copy_rows(copies)

    def hold(self) -> None:
        """Build the following executes' graphs without queueing them, until :meth:`release`.

        On the CPU ``mx.async_eval`` runs most of a step before it returns, so
        the engine reads the previous step back between building and queueing.
        """
        self._held = []

    def release(self) -> None:
        """Queue what was held back (nothing without :meth:`hold`)."""
        held, self._held = self._held, None
        if held:
            mx.async_eval(held)

    def _queue(self, *arrays: mx.array) -> None:
        if self._held is None:
            mx.async_eval(*arrays)
        else:
            self._held.extend(arrays)

    def execute(self, plan: StepPlan) -> StepOutput:
        """Build and queue ``plan``'s graph (``mx.async_eval``); nothing is waited for.

        Under :meth:`hold` the graph is only built; a failed call leaves nothing held.
        """
        mark = len(self._held) if self._held is not None else 0
        try:
            return self._execute(plan)
        except BaseException:
            self.pools.mirror = None  # it may hold some layers of the failed call
            if self._held is not None:
                del self._held[mark:]
            raise

    def _execute(self, plan: StepPlan) -> StepOutput:
        rows: list[RowPlan] = []
        parts: list[mx.array] = []
        verify_logits: mx.array | None = None
        mirror = None
        if plan.decode and not plan.verify:
            mirror = self.pools.mirror_for(
                tuple(r.seq for r in plan.decode), [r.start for r in plan.decode]
            )
        else:
            self.pools.mirror = None
        if plan.decode or plan.verify:
            # Decode and verify rows share one forward call (one read of the weights):
            # a decode row is a verify row without a draft, padded to the widest.
            dec, ver = plan.decode, plan.verify
            both = (*dec, *ver)
            width = max(r.n for r in both)
            tokens = mx.stack([_token_at(r) for r in both])[:, None]
            if width > 1:
                drafts = [[*r.draft, *[0] * (width - r.n)] for r in both]
                tokens = mx.concatenate([tokens, mx.array(drafts, dtype=mx.int32)], axis=1)
            cache = PagedKVCache(
                self.pools,
                [list(r.block_ids) for r in both],
                [r.start for r in both],
                [r.n for r in both] if width > 1 else 1,
                self._state_slots(both),
                mirror,
            )
            h = self._forward(tokens, cache, both, width)
            cache.commit()
            if not ver:
                parts.append(self.model.logits(h[:, -1, :]))
            else:
                at = [(b, 0) for b in range(len(dec))]
                at += [(len(dec) + i, j) for i, r in enumerate(ver) for j in range(r.n)]
                picked = h[
                    mx.array([b for b, _ in at], dtype=mx.int32),
                    mx.array([j for _, j in at], dtype=mx.int32),
                    :,
                ]
                logits = self.model.logits(picked)
                if dec:
                    parts.append(logits[: len(dec)])
                verify_logits = logits[len(dec) :]
            rows.extend(dec)
        groups = _prefill_groups(list(plan.prefill), ragged=not self.pools.has_state)
        for i, group in enumerate(groups):
            if i > 0 or plan.decode or plan.verify:
                self.pools.queue_call(h)  # now, held or not: the last call went first
            width = max(r.n for r in group)
            ids = []
            for r in group:
                if r.placeholder:
                    raise RuntimeError("a prefill chunk cannot include a token in flight")
                ids.append(r.seq.tokens[r.start : r.start + r.n] + [0] * (width - r.n))
            cache = PagedKVCache(
                self.pools,
                [list(r.block_ids) for r in group],
                [r.start for r in group],
                [r.n for r in group],
                self._state_slots(group),
            )
            h = self._forward(mx.array(ids, dtype=mx.int32), cache, group, None)
            cache.commit()
            last = [(b, r.n - 1) for b, r in enumerate(group) if r.samples]
            if last:
                rows_idx = mx.array([b for b, _ in last], dtype=mx.int32)
                cols_idx = mx.array([c for _, c in last], dtype=mx.int32)
                parts.append(self.model.logits(h[rows_idx, cols_idx, :]))
                rows.extend(group[b] for b, _ in last)
        verified: list[tuple[tuple[RowPlan, ...], mx.array, mx.array]] = []
        if verify_logits is not None:
            offsets = [0]
            for r in plan.verify:
                offsets.append(offsets[-1] + r.n)
            verify_rows = [
                speculate.VerifyRow(off, r.draft, r.seq.prepared.sampling, r.out_index)
                for off, r in zip(offsets, plan.verify, strict=False)
            ]
            tokens_v, counts_v = speculate.verify(verify_logits, verify_rows)
            verified.append((plan.verify, tokens_v, counts_v))
            self._queue(tokens_v, counts_v)
        if not rows:
            self._queue(*self.pools.arrays())
            return StepOutput(plan, (), None, verify=verified)
        out = self._execute_sampling(plan, rows, parts)
        out.verify = verified
        return out

    def _execute_sampling(
        self, plan: StepPlan, rows: list[RowPlan], parts: list[mx.array]
    ) -> StepOutput:
        raw = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        later = [i for i, r in enumerate(rows) if r.placeholder and _logits.needs_host_token(r.seq)]
        if not later:
            return self._sample(plan, tuple(rows), raw)
        now = [i for i in range(len(rows)) if i not in set(later)]
        deferred_logits = raw[mx.array(later, dtype=mx.int32)]
        out = StepOutput(plan, (), None)
        if now:
            out = self._sample(
                plan, tuple(rows[i] for i in now), raw[mx.array(now, dtype=mx.int32)]
            )
        else:
            self._queue(*self.pools.arrays())
        out.deferred = tuple(rows[i] for i in later)
        out.deferred_logits = deferred_logits
        self._queue(deferred_logits)
        return out

    def _forward(
        self, tokens: mx.array, cache: PagedKVCache, rows: Any, width: int | None
    ) -> mx.array:
        """One forward call; a vision model also gets each row's pictures and span
        (``(media, start, n)``: its image features go where its image tokens are)."""
        if not self._takes_images:
            return self.model(tokens, cache)  # type: ignore[no-any-return]
        feeds = [(r.seq.prepared.media, r.start, r.n if width is None else width) for r in rows]
        return self.model(tokens, cache, feeds)  # type: ignore[no-any-return]

    def _state_slots(self, rows: Any) -> list[tuple[int, tuple[int, ...]]] | None:
        """Per row (read slot, write slots) of a recurrent model's state, else None."""
        if not self.pools.has_state:
            return None
        return [(r.state_read, r.state_write) for r in rows]

    def sample_deferred(
        self, out: StepOutput, keep: list[int], masks: list[list[mx.array]]
    ) -> StepOutput:
        """Sample ``out``'s deferred rows ``keep`` (indices into ``out.deferred``) with
        their row masks (computed by the caller, now that their last token is known)."""
        assert out.deferred_logits is not None
        rows = tuple(out.deferred[i] for i in keep)
        if not rows:
            return StepOutput(StepPlan(), (), None)
        raw = out.deferred_logits[mx.array(keep, dtype=mx.int32)]
        return self._sample(StepPlan(), rows, raw, masks)

    def _sample(
        self,
        plan: StepPlan,
        rows: tuple[RowPlan, ...],
        raw: mx.array,
        masks: list[list[mx.array]] | None = None,
    ) -> StepOutput:
        seqs = [r.seq for r in rows]
        processed = _logits.process(seqs, raw, masks)
        sampled = sample_rows(
            processed, [r.seq.prepared.sampling for r in rows], [r.out_index for r in rows]
        )
        lp = _logits.step_logprobs(seqs, raw, sampled)
        self._queue(sampled, *(lp.arrays() if lp is not None else ()), *self.pools.arrays())
        return StepOutput(plan, rows, sampled, [(0, lp)] if lp is not None else [])

    def read(self, out: StepOutput) -> SampledStep:
        """Wait for ``out``; its tokens (and logprobs) on the host."""
        verified = read_verified(out)
        if out.sampled is None:
            mx.eval(self.pools.arrays())
            return SampledStep(out.plan, (), [], {}, verified)
        tokens: list[int] = out.sampled.tolist()  # type: ignore[assignment]
        lp = {off + row: v for off, part in out.logprobs for row, v in part.read().items()}
        return SampledStep(out.plan, out.rows, tokens, lp, verified)


def read_verified(
    out: StepOutput, *, by_row: bool = False
) -> list[tuple[RowPlan, list[int] | BaseException]]:
    """The verify rows' output tokens on the host (``by_row``: each row read alone,
    a row that fails gets its exception)."""
    done: list[tuple[RowPlan, list[int] | BaseException]] = []
    for rows, tokens, counts in out.verify:
        if not by_row:
            toks: list[list[int]] = tokens.tolist()  # type: ignore[assignment]
            cnt: list[int] = counts.tolist()  # type: ignore[assignment]
            done.extend((r, toks[i][: cnt[i] + 1]) for i, r in enumerate(rows))
            continue
        for i, r in enumerate(rows):
            try:
                c = int(counts[i].item())  # type: ignore[arg-type]
                row: list[int] = tokens[i].tolist()  # type: ignore[assignment]
                done.append((r, row[: c + 1]))
            except Exception as e:
                done.append((r, e))
    return done


def merge_outputs(parts: list[StepOutput]) -> StepOutput | None:
    """One step output from several launched separately (rows in order)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    plan = StepPlan(
        decode=tuple(r for p in parts for r in p.plan.decode),
        prefill=tuple(r for p in parts for r in p.plan.prefill),
        verify=tuple(r for p in parts for r in p.plan.verify),
    )
    sampled = [p.sampled for p in parts if p.sampled is not None]
    logprobs: list[tuple[int, _logits.StepLogprobs]] = []
    offset = 0
    for p in parts:
        logprobs.extend((offset + off, lp) for off, lp in p.logprobs)
        offset += len(p.rows)
    deferred = [p for p in parts if p.deferred]
    return StepOutput(
        plan,
        tuple(r for p in parts for r in p.rows),
        mx.concatenate(sampled) if sampled else None,
        logprobs,
        tuple(r for p in deferred for r in p.deferred),
        mx.concatenate([p.deferred_logits for p in deferred])  # type: ignore[misc]
        if deferred
        else None,
        [v for p in parts for v in p.verify],
    )


def _prefill_groups(chunks: list[RowPlan], *, ragged: bool = True) -> list[list[RowPlan]]:
    """Batch short prefill chunks into forward calls, padding each to its longest chunk.

    One call reads the weights once, which matters for short chunks only: a
    chunk of :data:`SOLO_PREFILL_TOKENS` or more already reads each weight once
    per that many tokens, and its attention over the context dominates, so it
    gets a call of its own (a padded row also attends over its whole context:
    on the agent workload, 316- and 194-token chunks over 3,000 cached tokens
    took 7.6 s as one padded call and 5.5 s as two). Short chunks are sorted
    by length and a group is cut when padding would exceed a quarter of its
    real tokens. ``ragged=False`` groups only chunks of one length: not every
    recurrent layer of mlx-lm keeps its state unchanged over right padding
    (Nemotron-H's Mamba does not), so hybrids are never padded.
    """
    groups: list[list[RowPlan]] = []
    for r in sorted(chunks, key=lambda c: -c.n):
        g = groups[-1] if groups else None
        if g is not None and g[0].n < SOLO_PREFILL_TOKENS:
            width = g[0].n
            if ragged:
                fits = (len(g) + 1) * width <= 1.25 * (sum(m.n for m in g) + r.n) + 16
            else:
                fits = width == r.n
            if fits:
                g.append(r)
                continue
        groups.append([r])
    return groups


def _token_at(r: RowPlan) -> mx.array:
    """The token a decode row feeds, as an int32 scalar (lazy if it is a placeholder)."""
    seq = r.seq
    known = len(seq.tokens)
    if r.start < known:
        return mx.array(seq.tokens[r.start], dtype=mx.int32)
    return seq.inflight[r.start - known].astype(mx.int32)
