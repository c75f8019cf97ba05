"""The one writer of request state: what a step computed becomes sequence state and Events.

The engine step (after vLLM v1)::

    plan = scheduler.schedule()        immutable plan; planning reserves blocks and
                                       may preempt (the block tables it hands out)
    out  = runner.execute(plan)        lazy: sampled ids (and logprobs); writes nothing
    update.launched(plan, out)         commit: rows advance, placeholders queue up,
                                       the blocks they fill join the prefix cache
    ...  next step executes  ...
    update.sampled(runner.read(out))   tokens join their sequences, full blocks join
                                       the prefix cache, text becomes Events, rows
                                       that are done end and give their blocks back

Cancellation, failures, finishing and the loss of a step in flight go through
here too (:meth:`StateUpdate.end`, :meth:`StateUpdate.fail`,
:meth:`StateUpdate.lost`), so a sequence's state has one writer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from mlx_cairn.engine.model_runner import SampledStep, StepOutput
from mlx_cairn.engine.output import SequenceOutput, token_text
from mlx_cairn.engine.plan import RowPlan, StepPlan
from mlx_cairn.engine.reasoning import ReasoningBudget
from mlx_cairn.engine.scheduler import Scheduler
from mlx_cairn.engine.sequence import Sequence
from mlx_cairn.types import (
    Admitted,
    Done,
    Error,
    Event,
    StopReason,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)

log = logging.getLogger("mlx_cairn.engine")

#: A row's read-back: its token, or why it could not be read.
RowResult = int | BaseException


class StateUpdate:
    """Applies steps to the engine's sequences (engine thread only).

    Args:
        scheduler: owns the queues, the block pool and the prefix cache.
        tokenizer: for the text side and logprob token strings.
        eos: end-of-sequence token ids.
        left_queue: called once per request when it stops counting against
            ``max_queue`` (admitted, or ended before admission).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        eos: frozenset[int],
        left_queue: Callable[[], None],
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos = eos
        self._left_queue = left_queue
        #: Live sequences by request id.
        self.seqs: dict[int, Sequence] = {}
        self.requests = 0
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.generated_tokens = 0
        #: Prompt positions whose KV was computed (launched), not taken from the cache;
        #: a prompt computed again after a preemption counts again.
        self.prefill_tokens = 0
        #: Speculative decoding: verify rows applied, their draft tokens, those accepted.
        self.verify_rows = 0
        self.draft_proposed = 0
        self.draft_accepted = 0
        self._token_text: dict[int, tuple[str, tuple[int, ...]]] = {}

    # ------------------------------------------------------------ membership

    def arrive(self, seq: Sequence) -> None:
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        self.requests += 1

    def live(self, seq: Sequence) -> bool:
        return self.seqs.get(seq.request_id) is seq

    def cancel(self, request_id: int) -> None:
        if (seq := self.seqs.get(request_id)) is not None:
            self.cancelled += 1
            self.end(seq, Error("cancelled", "the request was cancelled"))

    def fail(self, seq: Sequence, phase: str, err: BaseException) -> None:
        """End one request that failed; the others go on."""
        if not self.live(seq):
            return
        log.warning("request %d failed while %s: %s", seq.request_id, phase, err)
        self.failed += 1
        self.end(seq, Error("internal", f"generation failed: {err}"))

    def fail_all(self, message: str, *, count: bool = True) -> None:
        for seq in list(self.seqs.values()):
            if count:
                self.failed += 1
            self.end(seq, Error("internal", message))

    def end(self, seq: Sequence, final: Done | Error | None) -> None:
        """Remove ``seq`` (freeing its blocks) and end its stream (``final`` None:
        it completed, and its Done follows)."""
        if self.seqs.pop(seq.request_id, None) is None:
            return
        if seq.t_admit == 0.0:
            self._left_queue()
            seq.t_admit = -1.0  # counted out of the queue
        if final is None:
            self.scheduler.finish(seq)
        else:
            self.scheduler.remove(seq)
        seq.stream.output_ids = seq.tokens[seq.num_prompt :]
        if final is not None:
            seq.stream._finish(final)

    # ------------------------------------------------------------ a step

    def admitted(self, plan: StepPlan, now: float) -> None:
        """Rows running for the first time leave the queue and say so."""
        for seq in plan.sequences():
            if seq.t_admit == 0.0:
                seq.t_admit = now
                self._left_queue()
                seq.stream._push([Admitted(seq.num_prompt, max(seq.cached_tokens, 0))])

    def launched(self, out: StepOutput) -> None:
        """Commit a launched step: rows advance by what they fed, samples queue as placeholders.

        The full blocks of known tokens the step fills are registered now, not when
        it is read back (a prefill chunk is never read back): the next plan's
        admissions then find a prompt's blocks chunk by chunk and join a prefix
        being computed instead of computing it again (Scheduler._joins).
        """
        for r in out.plan.rows:
            seq = r.seq
            self.prefill_tokens += max(0, min(r.start + r.n, seq.num_prompt) - r.start)
            seq.num_computed = r.start + r.n
            if seq.state_slot:  # recurrent state: later steps read the live slot
                seq.state_read = seq.state_slot
                if seq.plan_snapshot:
                    nb = seq.num_computed // self.scheduler.block_size
                    seq.pending_snapshots.append((nb, seq.plan_snapshot))
                    seq.plan_snapshot = 0
                if r.boundary:
                    seq.boundary_blocks = r.boundary
            if self.live(seq):
                self.scheduler.register(seq)
        for r in out.plan.verify:
            r.seq.verifying = True
        self.queued(out)

    def queued(self, out: StepOutput) -> None:
        """Queue a step's lazy samples as their rows' placeholders."""
        if out.sampled is not None:
            for i, r in enumerate(out.rows):
                r.seq.inflight.append(out.sampled[i])

    def sampled(self, step: SampledStep, results: list[RowResult] | None = None) -> None:
        """Apply a step's read-back tokens (``results`` overrides ``step.tokens`` per row)."""
        now = time.perf_counter()
        values: list[RowResult] = list(step.tokens) if results is None else results
        hook = self.row_hook
        for i, (r, token) in enumerate(zip(step.rows, values, strict=True)):
            seq = r.seq
            if not self.live(seq):
                continue  # ended (cancelled, failed, finished) while in flight
            if isinstance(token, BaseException):
                self.fail(seq, "read back", token)
                continue
            try:
                if hook is not None:
                    hook("update", seq)
                self._apply_token(seq, token, step.logprobs.get(i), now)
            except Exception as e:  # one row's text side or bookkeeping: that row only
                self.fail(seq, "updated", e)
        for r, got in step.verified:
            seq = r.seq
            if not self.live(seq):
                continue
            seq.verifying = False
            if isinstance(got, BaseException):
                self._roll_back(seq)
                self.fail(seq, "read back", got)
                continue
            try:
                if hook is not None:
                    hook("update", seq)
                self._apply_verified(r, got, now)
            except Exception as e:
                self.fail(seq, "updated", e)

    #: Test hook (phase, sequence), set by the engine's fault hooks.
    row_hook: Callable[[str, Sequence], None] | None = None

    def lost(self, out: StepOutput) -> None:
        """A launched step will never be read back: undo its placeholders.

        A lost sampled token means the last known token is fed again (its KV
        row is rewritten, identically), or the sequence would have nothing
        pending and never finish.
        """
        now = time.perf_counter()
        states = self.scheduler.states
        if states is not None:  # its state writes may not have happened
            states.drop_all()
        for r in (*out.plan.rows, *out.rows, *out.deferred):
            seq = r.seq
            if states is not None and self.live(seq):
                self._recompute_state(seq)
            if seq.inflight:
                seq.inflight.clear()
                seq.num_computed = min(seq.num_computed, len(seq.tokens) - 1)
                self._recompute_state(seq)
            if seq.verifying:
                self._roll_back(seq)
            if seq.forced is not None and self.live(seq):
                try:
                    self._apply_forced(seq, now)  # or it would never be scheduled again
                except Exception as e:
                    self.fail(seq, "updated", e)

    def _roll_back(self, seq: Sequence) -> None:
        """A verify row's result is lost: its last known token is pending again."""
        seq.verifying = False
        seq.num_computed = min(seq.num_computed, len(seq.tokens) - 1)
        if seq.spec is not None:
            seq.spec.draft_computed = min(seq.spec.draft_computed, len(seq.tokens))
        self.scheduler.trim(seq)

    def _recompute_state(self, seq: Sequence) -> None:
        """A recurrent state has taken in tokens that are being rolled back: unlike
        KV rows, it cannot be rewritten in place, so the sequence is recomputed
        (from its longest snapshot) as after a preemption."""
        if seq.state_slot and seq in self.scheduler.running:
            self.scheduler.preempt(seq)

    def unstick(self) -> None:
        """Nothing could run and nothing is in flight: end what can never progress.

        With the capacity check in prepare() and the rules of the scheduler
        none of this should happen; if it does, the loop must not spin on it.
        """
        sched = self.scheduler
        for seq in list(sched.running):
            if seq.num_pending == 0 and seq.forced is None:
                self.fail(seq, "stuck", RuntimeError("the request has nothing left to run"))
        if sched.waiting and not sched.running:
            seq = sched.waiting[0]
            self.end(seq, Error("internal", "the request does not fit in the KV cache"))

    # ------------------------------------------------------------ one token

    def _apply_token(
        self,
        seq: Sequence,
        token: int,
        logprob: tuple[float, list[tuple[int, float]]] | None,
        now: float,
    ) -> None:
        seq.inflight.popleft()
        if seq.forced is not None:
            # Sampled after the reasoning budget ran out: replaced by the forced ids.
            if not seq.inflight:
                self._apply_forced(seq, now)
            return
        seq.tokens.append(token)
        self.scheduler.register(seq)
        if self._on_token(seq, token, now, logprob) and seq.spec is not None:
            seq.spec.observe(seq.tokens, 1)

    def _apply_verified(self, r: RowPlan, tokens: list[int], now: float) -> None:
        """A verify row's output: its accepted drafts, then one more token, each taken
        in order as if sampled alone; the rejected positions roll back.

        Each token leaves its predecessor's KV row valid, so ``num_computed`` follows
        the known tokens (one behind); the row stops early when the request ends
        or the reasoning budget forces its close (the tokens after it are dropped).
        """
        seq = r.seq
        spec = seq.spec
        accepted = len(tokens) - 1
        if spec is not None:
            spec.record(len(r.draft), accepted)
        self.verify_rows += 1
        self.draft_proposed += len(r.draft)
        self.draft_accepted += accepted
        start = len(seq.tokens)
        if spec is not None:  # a draft model's KV is right up to the accepted drafts
            spec.draft_computed = min(spec.draft_computed, start + accepted)
        end = seq.num_computed  # past the draft (0 if it was preempted meanwhile)
        for token in tokens:
            seq.tokens.append(token)
            seq.num_computed = min(end, len(seq.tokens) - 1)
            self.scheduler.register(seq)
            n = len(seq.tokens)
            if not self._on_token(seq, token, now, None):
                return
            if len(seq.tokens) != n:  # the forced close of reasoning took over
                break
        seq.num_computed = min(seq.num_computed, len(seq.tokens) - 1)
        self.scheduler.trim(seq)
        if spec is not None:
            spec.observe(seq.tokens, len(seq.tokens) - start)

    def _apply_forced(self, seq: Sequence, now: float) -> None:
        """Append the forced ids (the close of reasoning) as if they had been sampled.

        Tokens sampled in their place were never fed to the model (a sequence
        with forced ids is not scheduled), so nothing is rolled back but the
        count of computed tokens, which may have run ahead onto them.
        """
        forced, seq.forced = seq.forced or [], None
        if seq.num_computed > len(seq.tokens):
            seq.num_computed = len(seq.tokens)
            self._recompute_state(seq)
        for t in forced:
            seq.tokens.append(t)
            if not self._on_token(seq, t, now, None):
                return
        self.scheduler.register(seq)

    def _on_token(
        self,
        seq: Sequence,
        token: int,
        now: float,
        logprob: tuple[float, list[tuple[int, float]]] | None,
    ) -> bool:
        """Turn one new token into Events; False once the sequence has ended."""
        self.generated_tokens += 1
        if seq.t_first_token == 0.0:
            seq.t_first_token = now
        if seq.pipeline is None:
            seq.pipeline = SequenceOutput(self.tokenizer, seq.prepared)
            p = seq.prepared
            if p.reasoning_budget is not None:
                seq.budget = ReasoningBudget(
                    budget=p.reasoning_budget,
                    open_ids=p.reasoning_tags[0],
                    close_ids=p.reasoning_tags[1],
                    in_reasoning=p.in_reasoning,
                )
        out: SequenceOutput = seq.pipeline
        reason: StopReason | None = None
        matched: str | None = None
        try:
            if self.row_hook is not None:
                self.row_hook("detokenize", seq)
            if token in self.eos or token in seq.prepared.stop_token_ids:
                events = out.flush()
                reason = "end_turn"
            else:
                events, matched = out.push(token)
                if logprob is not None:
                    events.insert(0, self._logprob_event(token, logprob))
                if out.repeated:  # a forced turn's repeated call ends it (SequenceOutput)
                    reason = "end_turn"
                elif matched is not None:
                    reason = "stop_sequence"
                elif seq.num_output >= seq.prepared.max_tokens:
                    events += out.flush(cut=True)
                    reason = "max_tokens"
        except Exception as e:  # a text-side failure ends only this request
            log.warning("text pipeline failed: %s", e)
            self.failed += 1
            self.end(seq, Error("internal", f"output processing failed: {e}"))
            return False
        if reason == "end_turn" and out.saw_tool_call:
            reason = "tool_use"
        if self.row_hook is not None:
            self.row_hook("push", seq)
        if reason is None:
            seq.stream._push(events)
            if seq.budget is not None and (force := seq.budget.push(token)) is not None:
                # Close the reasoning unless max_tokens would cut the tag itself.
                if seq.num_output + len(force) < seq.prepared.max_tokens:
                    seq.forced = force
                if seq.forced is not None and not seq.inflight:
                    self._apply_forced(seq, now)
            return self.live(seq)
        self.completed += 1
        self.end(seq, None)
        seq.stream._push([*events, self._done(seq, reason, matched, now)])
        return False

    def _logprob_event(self, token: int, logprob: tuple[float, list[tuple[int, float]]]) -> Event:
        chosen, top = logprob
        text, raw = self._text_of(token)
        alts = []
        for tid, lp in top:
            t, b = self._text_of(tid)
            alts.append(TopLogprob(t, tid, lp, b))
        return TokenLogprob(text, token, chosen, raw, tuple(alts))

    def _text_of(self, token: int) -> tuple[str, tuple[int, ...]]:
        hit = self._token_text.get(token)
        if hit is None:
            hit = self._token_text[token] = token_text(self.tokenizer, token)
        return hit

    def _done(self, seq: Sequence, reason: StopReason, matched: str | None, now: float) -> Done:
        prompt = seq.num_prompt
        cached = max(seq.cached_tokens, 0)
        first = seq.t_first_token or now
        decode_n = seq.num_output - 1
        timings = Timings(
            queue_ms=1000 * (seq.t_admit - seq.t_submit) if seq.t_admit else 0.0,
            ttft_ms=1000 * (first - seq.t_submit),
            prefill_tokens_per_s=(prompt - cached) / (first - seq.t_admit)
            if seq.t_admit > 0 and first > seq.t_admit
            else 0.0,
            decode_tokens_per_s=decode_n / (now - first) if decode_n > 0 and now > first else 0.0,
        )
        spec = seq.spec
        usage = Usage(
            input_tokens=prompt,
            output_tokens=seq.num_output,
            cached_tokens=cached,
            draft_tokens=spec.proposed if spec is not None else 0,
            accepted_draft_tokens=spec.accepted if spec is not None else 0,
        )
        return Done(stop_reason=reason, matched_stop=matched, usage=usage, timings=timings)
