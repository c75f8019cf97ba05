"""One engine step's plan: which rows run, on which blocks, fed which tokens.

The scheduler (engine/scheduler.py) builds a :class:`PlanBuilder` while it
decides a step (preemption may still take rows out), then freezes it into an
immutable :class:`StepPlan` of :class:`RowPlan` rows. Everything after that
reads the plan and never changes it: the model runner's forward calls
(engine/model_runner.py; across ranks, engine/distributed.py broadcasts each
call's inputs from it), draft proposals (engine/draft.py) and the state
update that follows (engine/update.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mlx_cairn.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class RowPlan:
    """One sequence's part of a step, fixed when the step is planned::

    tokens + inflight:  ... | start ........ start+n | ...
                              fed this step (n)
    placeholder: the fed tokens include the look-ahead token, sampled by
                 the step before and not read back yet (a lazy array)
    samples:     start + n reaches the end of the known + in-flight tokens,
                 so this row samples the next token
    """

    seq: Sequence
    start: int
    n: int
    samples: bool
    placeholder: bool
    #: The sequence's block table at planning time (covers start + n tokens).
    block_ids: tuple[int, ...]
    #: Index of the output token this row samples (keys its random stream).
    out_index: int
    #: Recurrent state (hybrid models): the slot the row reads its state from
    #: (its own, a snapshot's on a prefix hit, 0 = fresh zeros) ...
    state_read: int = 0
    #: ... and the slots its new state is written to (its own first).
    state_write: tuple[int, ...] = ()
    #: Blocks up to ``start + n`` when the row ends on a block boundary and
    #: writes its boundary slot (0: it does not).
    boundary: int = 0
    #: A verify row (speculative decoding, engine/speculate.py): the draft tokens
    #: fed after the last known one (``n = 1 + len(draft)``); every fed token
    #: is scored.
    draft: tuple[int, ...] = ()
    #: Partial-block reuse: (source block, this row's block, rows) to copy before
    #: the step's forward calls (the first ``rows`` positions of the block).
    copy: tuple[int, int, int] | None = None

    @staticmethod
    def of(seq: Sequence, n: int, block_size: int = 0) -> RowPlan:
        end = seq.num_computed + n
        write: tuple[int, ...] = ()
        boundary = 0
        if seq.state_slot:
            write = (seq.state_slot,)
            if seq.plan_snapshot:
                write += (seq.plan_snapshot,)
            elif seq.boundary_slot and end % block_size == 0:
                boundary = end // block_size
                write += (seq.boundary_slot,)
        return RowPlan(
            seq=seq,
            start=seq.num_computed,
            n=n,
            samples=end == seq.num_tokens,
            placeholder=end > len(seq.tokens),
            block_ids=tuple(seq.block_ids),
            out_index=seq.num_tokens - seq.num_prompt,
            state_read=seq.state_read,
            state_write=write,
            boundary=boundary,
        )


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one engine step computes (immutable once planned)."""

    #: Rows decoding one token each (one batched forward call).
    decode: tuple[RowPlan, ...] = ()
    #: Prefill chunks.
    prefill: tuple[RowPlan, ...] = ()
    #: Verify rows: a known token and its draft (speculative decoding).
    verify: tuple[RowPlan, ...] = ()
    #: Sequences whose planning raised (already removed, blocks freed), with why.
    failed: tuple[tuple[Sequence, BaseException], ...] = ()

    @property
    def rows(self) -> tuple[RowPlan, ...]:
        return (*self.decode, *self.prefill, *self.verify)

    def sequences(self) -> list[Sequence]:
        return [r.seq for r in self.rows]

    def only(self, seq: Sequence) -> StepPlan:
        """The part of this plan that runs ``seq``."""
        return StepPlan(
            decode=tuple(r for r in self.decode if r.seq is seq),
            prefill=tuple(r for r in self.prefill if r.seq is seq),
            verify=tuple(r for r in self.verify if r.seq is seq),
        )

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill or self.verify)


@dataclass(slots=True)
class PlanBuilder:
    """A plan while the scheduler builds it (preemption may still take rows out)."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    verify: list[tuple[Sequence, tuple[int, ...]]] = field(default_factory=list)
    failed: list[tuple[Sequence, BaseException]] = field(default_factory=list)
    copies: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # id(seq) ->

    def discard(self, seq: Sequence) -> None:
        self.copies.pop(id(seq), None)
        if seq in self.decode:
            self.decode.remove(seq)
        self.prefill = [(s, n) for s, n in self.prefill if s is not seq]
        self.verify = [(s, d) for s, d in self.verify if s is not seq]

    def has(self, seq: Sequence) -> bool:
        return (
            seq in self.decode
            or any(s is seq for s, _ in self.prefill)
            or any(s is seq for s, _ in self.verify)
        )

    def freeze(self, block_size: int) -> StepPlan:
        def row(s: Sequence, n: int) -> RowPlan:
            r = RowPlan.of(s, n, block_size)
            copy = self.copies.get(id(s))
            return r if copy is None else replace(r, copy=copy)

        return StepPlan(
            decode=tuple(row(s, 1) for s in self.decode),
            prefill=tuple(row(s, n) for s, n in self.prefill),
            verify=tuple(
                replace(RowPlan.of(s, 1, block_size), n=1 + len(d), draft=d) for s, d in self.verify
            ),
            failed=tuple(self.failed),
        )
