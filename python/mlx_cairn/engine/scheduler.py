"""Continuous-batching scheduler: admission, chunked prefill, block allocation, preemption.

Pure bookkeeping over the Rust ``BlockPool`` / ``PrefixCache``; no MLX here.
Each call to :meth:`Scheduler.schedule` plans one engine step::

    budget = step_token_budget
    1. decode: every admitted sequence with exactly one pending token gets a row
       (oldest first); a row that needs a new block and finds none preempts the
       youngest admitted sequence (possibly itself);
    2. prefill (unless decoding rows are owed time, see below): older
       partially-prefilled sequences continue, then new ones are
       admitted from the FIFO queue (prefix-cache lookup first), each taking a
       chunk of the remaining budget (all of its prompt when the rest would be a
       sliver of at most 1/TAIL_FRACTION of the budget, so the step may go over
       by that much);
    admission stops at the first request that cannot get its blocks (FIFO),
    or when ``max_batch`` sequences are admitted.

A step with prefill chunks makes its decoding rows wait for them (on a CPU,
or a Mac at long context, a 512-token chunk over a 3,000-token context takes
seconds): the engine reports each step's time (``step_done``), and after a
step that prefilled beside decoding rows, the next steps decode only until
those rows have had :data:`DECODE_SHARE` of the time. The step in flight
counts too (it was planned with prefill: the next plan decodes only), so
streams keep moving at no less than about half their own speed while other
requests prefill, and the prefill total is unchanged (the same chunks, later)::

    step      1: decode + chunk (3 s)  2..k: decode only (3 s)  k+1: decode + chunk ...

Preempted sequences drop their blocks (full ones stay in the prefix cache)
and go back to the queue in arrival order, ahead of newer requests.

A prompt whose cached prefix ends inside a block reuses that block's leading
rows too: the scheduler remembers, for each registered block, the block
before it and its tokens; an admitted sequence whose next block starts like a
cached one copies those rows into its own new block (``RowPlan.copy``, applied
before the step's forward calls) instead of computing them::

    cached      [b0][b1: t16..t31          ]
    new prompt  [b0][b1': t16..t29 | u30 ..]  -> b1' gets rows 0..13 of b1

A prefix that another admitted sequence is computing is joined, not computed
twice: a queued request whose next uncached blocks (at least
:data:`JOIN_MIN_TOKENS` of them, or all it could take from the cache) are
pending in a running sequence -- planned in this very step, or in a later
chunk -- waits aside (the others are admitted meanwhile). Blocks join the
prefix cache as soon as the step that fills them is launched
(``StateUpdate.launched``), so the next plan's lookup takes them by
reference; when the leader is cancelled or preempted it stops claiming them
and the waiter computes what is not cached itself::

    step 1   A: [p0 .. p31] planned      B: next block p0 is A's: waits
    step 2   A: [p32 .. p63] planned     B: hits p0..p31, p32 is A's: waits
    step k   A: [.. p186 a187 ..]        B: hits p0..p186, b187 is its own: admitted

Each sequence keeps its chained block hashes (``Sequence.block_hashes``) and
extends them by the newly full blocks only, so a long generation hashes each
token once instead of re-hashing its whole prefix whenever a block fills.

Models with recurrent layers (``states``, engine/hybrid_state.py) also get two state
slots per admitted sequence; a prefix hit only counts up to the longest block
whose state snapshot exists, and prefill chunks are cut at the snapshot points
so the state there is written to a snapshot slot.

With a disk tier (engine/disk.py), an allocation hands the cached blocks it
is about to evict to ``on_evict`` first, and a prefix whose hit goes on past
the resident blocks is read from disk while its request waits aside (the
others are admitted meanwhile); ``on_loaded`` puts the blocks in the pool and
the request is admitted as a hit.

With KV events on (``events``, engine/kv_events.py), the blocks each
registration adds to the cache are reported stored (chain hash, parent,
token ids), and the cached blocks an allocation hands out again reported
removed; with them off, neither costs anything.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mlx_cairn.engine.hybrid_state import StateSlots
from mlx_cairn.engine.plan import PlanBuilder, StepPlan
from mlx_cairn.engine.sequence import Sequence

#: Draft tokens one step scores at most, shared out among its running rows
#: (speculative decoding; bench/bench_speculative.py: at 8 rows, 2 draft tokens
#: each cost +30% over a plain decode step on this CPU, 8 each +120%).
STEP_DRAFT_TOKENS = 16

#: A prompt whose rest after this step's chunk would be at most 1/TAIL_FRACTION of the
#: step budget is prefilled whole now (Scheduler._take).
TAIL_FRACTION = 8

#: Fewest leading rows of a cached block worth copying into a new one (partial-block
#: reuse): a copy first waits for the step in flight, and a few rows (a chat
#: template's opening tokens, shared by every prompt) save less than that costs.
MIN_PARTIAL_ROWS = 8
#: Cached blocks remembered per preceding block as partial-reuse sources (the newest).
PARTIAL_CHILDREN = 32

#: Fewest prompt tokens a running sequence must be computing for a new request that
#: shares them to wait for it (Scheduler._joins): waiting costs the request a step,
#: worth it for a shared system prompt, not for a chat template's opening block.
JOIN_MIN_TOKENS = 64

#: While sequences decode, at least this share of the engine's time goes to steps
#: without prefill (Scheduler.step_done): a step that prefills next to decoding
#: rows makes them wait for its chunk, so the steps after it decode only until
#: they have had as much time again. 0 turns it off.
DECODE_SHARE = 0.5
#: Most decode-only seconds owed at once (a very long chunk does not stall
#: prefill for longer than this).
MAX_DECODE_OWED_S = 10.0


class Scheduler:
    """Queue + admitted set of sequences over a block pool and prefix cache."""

    def __init__(
        self,
        pool: Any,
        cache: Any,
        *,
        max_batch: int,
        step_token_budget: int,
        states: StateSlots | None = None,
    ) -> None:
        self.pool = pool
        self.cache = cache
        #: Recurrent-state slots and snapshots (models with recurrent layers), or None.
        self.states = states
        #: The disk tier (engine/disk.py) and the engine's hooks for it: blocks about
        #: to be evicted, and a request whose blocks were read back.
        self.disk: Any = None
        self.on_evict: Callable[[list[tuple[int, int]]], None] | None = None
        self.on_loaded: Callable[[Sequence], None] | None = None
        #: KV-cache events for a router (engine/kv_events.py), or None: blocks that
        #: join the cache and cached blocks evicted are reported to it.
        self.events: Any = None
        #: With events: the cached blocks reported stored (block id -> hash). A cached
        #: block leaves the cache only when ``allocate`` hands it out again, so the
        #: ids it returns tell the evictions without reading the free list.
        self._stored_ids: dict[int, int] = {}
        self.block_size: int = pool.block_size
        self.max_batch = max_batch
        self.step_token_budget = step_token_budget
        #: Draft tokens a step scores at most (speculative decoding).
        self.step_draft_tokens = STEP_DRAFT_TOKENS
        #: Not admitted, sorted by arrival (preempted ones keep their old place).
        self.waiting: list[Sequence] = []
        #: Admitted (holding blocks), sorted by arrival.
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        #: Partial-reuse sources: (preceding block's hash, or the salt for a first
        #: block; block hash) -> (block id, its tokens), least recently used first.
        #: Entries go stale when a block is evicted; a use checks the cache first.
        self._sources: OrderedDict[tuple[Any, int], tuple[int, tuple[int, ...]]] = OrderedDict()
        self._by_parent: dict[Any, dict[int, None]] = {}  # preceding block -> its sources
        #: Tokens admitted sequences got from partial-block copies.
        self.partial_hit_tokens = 0
        #: See :data:`JOIN_MIN_TOKENS` (tests lower it for tiny blocks).
        self.join_min_tokens = JOIN_MIN_TOKENS
        #: Admissions put off because a running sequence was computing their prefix.
        self.join_waits = 0
        #: See :data:`DECODE_SHARE`.
        self.decode_share = DECODE_SHARE
        #: Seconds of decode-only steps owed to decoding rows, and the last plan
        #: that prefilled beside them while it is in flight.
        self._owed_s = 0.0
        self._mixed: StepPlan | None = None
        #: Steps whose prefill waited for decoding rows.
        self.prefill_holds = 0

    # ------------------------------------------------------------- membership

    def add(self, seq: Sequence) -> None:
        """Queue a new or preempted sequence at its arrival position."""
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def remove(self, seq: Sequence) -> bool:
        """Drop ``seq`` wherever it is, freeing its blocks. Returns whether it was known."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
            return True
        if seq in self.waiting:
            self.waiting.remove(seq)
            return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def loading(self) -> list[Any]:
        """The disk reads waiting requests wait for (engine/disk.py)."""
        return [s.disk_read for s in self.waiting if s.disk_read is not None]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -------------------------------------------------------------- planning

    def schedule(self, check: Callable[[Sequence], None] | None = None) -> StepPlan:
        """Plan one step (see the module docstring).

        A sequence whose planning raises (``check`` is a test hook called first
        for each) is dropped, its blocks freed, and listed in ``plan.failed``;
        the others are planned as if it had not been there.
        """
        plan = PlanBuilder()
        for seq in list(self.running):
            if seq not in self.running:
                continue
            try:
                if check is not None:
                    check(seq)
                if seq.num_pending != 1 or not seq.wants_more or seq.forced is not None:
                    continue
                draft = self._draft(seq)
                if self._grow(seq, 1 + len(draft), plan):
                    if draft:
                        plan.verify.append((seq, draft))
                    else:
                        plan.decode.append(seq)
            except Exception as e:
                self._drop(seq, e, plan)
        budget = self.step_token_budget - len(plan.decode)
        budget -= sum(1 + len(d) for _, d in plan.verify)
        if (plan.decode or plan.verify) and self._owes_decode():
            budget = 0  # decoding rows are owed time: no prefill this step
            self.prefill_holds += 1
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq not in self.running or seq.num_pending <= 1 or plan.has(seq):
                continue
            try:
                n = self._chunk(seq, self._take(seq.num_pending, budget))
                if self._grow(seq, n, plan):
                    plan.prefill.append((seq, n))
                    budget -= n
            except Exception as e:
                self._drop(seq, e, plan)
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_batch:
                break
            if seq.inflight or seq.verifying:
                break  # preempted with tokens in flight: recompute once they are known
            if seq.disk_read is not None:
                if not seq.disk_read.done():
                    continue  # its blocks are being read from disk: the others go on
                if self.on_loaded is not None:
                    self.on_loaded(seq)
                seq.disk_read = None
            try:
                if check is not None:
                    check(seq)
                n = self._admit(seq, budget, plan)
            except Exception as e:
                self._drop(seq, e, plan)
                continue
            if n < 0:
                continue  # it waits aside (a disk read, another's prefill): the others go on
            if n == 0:
                break
            if seq.num_pending == 1 and n == 1:
                plan.decode.append(seq)
            else:
                plan.prefill.append((seq, n))
            budget -= n
        if self.states is not None:
            # After planning (its allocations may have evicted cached blocks): the
            # snapshots of evicted prefixes go now. Slots this plan reads are only
            # reused by later plans, whose writes come after its reads.
            self.states.trim(self.cache, headroom=self.max_batch)
        frozen = plan.freeze(self.block_size)
        if frozen.prefill and (frozen.decode or frozen.verify):
            self._mixed = frozen
        return frozen

    def _owes_decode(self) -> bool:
        return self.decode_share > 0 and (self._owed_s > 0 or self._mixed is not None)

    def step_done(self, plan: StepPlan, seconds: float) -> None:
        """A launched step took ``seconds``: settle what decoding rows are owed
        (:data:`DECODE_SHARE`)."""
        if plan is self._mixed:
            self._mixed = None
        if not (plan.decode or plan.verify):
            self._owed_s = 0.0  # nobody was decoding
        elif plan.prefill:
            share = min(self.decode_share, 0.95)
            owed = self._owed_s + seconds * share / (1.0 - share)
            self._owed_s = min(MAX_DECODE_OWED_S, owed)
        else:
            self._owed_s = max(0.0, self._owed_s - seconds)

    def _draft(self, seq: Sequence) -> tuple[int, ...]:
        """A speculating row's draft for its next token (empty: it decodes one token).

        Only a row whose pending token is known proposes (its look-ahead token
        would be a guess), and never past ``max_tokens``."""
        spec = seq.spec
        if spec is None or seq.inflight or seq.row_masks:
            return ()
        room = seq.prepared.max_tokens - seq.num_output - 1
        # Scored tokens cost more the more rows share the step: the step's draft
        # tokens are shared out among its rows (all of them for a single stream).
        room = min(room, max(1, self.step_draft_tokens // max(1, len(self.running))))
        draft = tuple(spec.propose(seq.tokens, room)) if room > 0 else ()
        if draft:  # a draft never preempts anyone: shorten it to the free blocks
            end = seq.num_computed + 1
            fits = (len(seq.block_ids) + self.pool.num_free_blocks) * self.block_size - end
            draft = draft[: max(0, fits)]
        return draft

    def wants_sync(self) -> bool:
        """Whether a running row needs the step in flight read back before planning:
        a verify row's tokens decide its next row; a speculating row whose end
        matched can propose once its look-ahead token is known."""
        return any(
            s.verifying or (s.spec is not None and s.spec.wants and s.inflight)
            for s in self.running
        )

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past what ``seq`` needs for its next token (a verify row's
        rejected positions); they were never registered."""
        if seq not in self.running:
            return
        keep = max(self.blocks_needed(seq.num_computed + 1), seq.num_registered)
        if len(seq.block_ids) > keep:
            self.pool.free(seq.block_ids[keep:])
            del seq.block_ids[keep:]

    def _drop(self, seq: Sequence, err: BaseException, plan: PlanBuilder) -> None:
        """Take a sequence whose planning failed out of the plan and the queues."""
        plan.discard(seq)
        self.remove(seq)
        plan.failed.append((seq, err))

    def _admit(self, seq: Sequence, budget: int, plan: PlanBuilder | None = None) -> int:
        """Admit the queue head: prefix lookup + blocks for its first chunk. 0 if it cannot,
        -1 if it waits aside (its prefix is being computed or read from disk)."""
        # The kept chain covers the registered blocks (none at first admission);
        # the rest of the tokens continue it for this lookup only.
        head = self._hashes(seq, 0)
        rest = seq.hash_tokens(len(head) * self.block_size)
        hashes = self.cache.hash_blocks(rest, prefix=head)
        hit = list(self.cache.lookup(hashes))
        if self._joins(seq, hashes, len(hit)):
            if hit:
                self.pool.free(hit)
            self.join_waits += 1
            return -1
        if self.disk is not None and not seq.disk_tried:
            seq.disk_tried = True
            k, snap = self._disk_plan(
                hashes, hit, min(len(hashes), (len(seq.tokens) - 1) // self.block_size)
            )
            if k > 0 or snap:  # the cached prefix goes on on disk: read it, admit afterwards
                if hit:
                    self.pool.free(hit)
                seq.disk_start = len(hit)
                seq.disk_snap_blocks = snap
                seq.disk_read = self.disk.read(
                    [int(hashes[i]) for i in range(len(hit), len(hit) + k)],
                    int(hashes[snap - 1]) if snap else None,
                )
                return -1
        new: list[int] | None = []
        n = 0
        try:  # the lookup took references: give them back if anything below fails
            if self.states is not None:
                hit = self._state_hit(seq, hashes, hit)
                if not seq.state_slot:
                    new = None  # no state slot free: wait, as for blocks
            computed = len(hit) * self.block_size
            partial = self._partial(seq, hashes, len(hit)) if plan is not None else None
            if partial is not None:
                computed += partial[1]
            seq.num_computed = computed
            if new is not None:
                n = self._chunk(seq, self._take(len(seq.tokens) - computed, budget))
                need = self.blocks_needed(computed + n) - len(hit)
                new = self._allocate(need) if need > 0 else []
        except BaseException:
            self._unadmit(seq, hit)
            raise
        if new is None:
            self._unadmit(seq, hit)
            return 0
        self.waiting.remove(seq)
        if self.states is not None and seq.state_read:
            self.states.hits += 1
            self.states.hit_tokens += computed
        seq.block_ids = hit + list(new)
        seq.num_computed = computed
        if partial is not None and plan is not None:
            # The first new block takes the source's leading rows (copied before
            # this step's forward calls, so a source evicted by this very plan is
            # read first).
            plan.copies[id(seq)] = (partial[0], seq.block_ids[len(hit)], partial[1])
            self.partial_hit_tokens += partial[1]
        if seq.spec is not None:  # a draft model's KV: trusted as far as the hit goes
            seq.spec.draft_computed = min(seq.spec.draft_computed, computed)
        seq.num_registered = len(hit)
        seq.admit_hashes = hashes
        if seq.cached_tokens < 0:  # first admission: this is the real prefix hit
            seq.cached_tokens = min(computed, seq.num_prompt)
            self.prefix_hit_tokens += seq.cached_tokens
        bisect.insort(self.running, seq, key=lambda s: s.arrival)
        return n

    def _joins(self, seq: Sequence, hashes: Any, start: int) -> bool:
        """Whether a running sequence is computing ``seq``'s blocks from ``start`` on (the
        first it did not find cached): at least :data:`JOIN_MIN_TOKENS` of them, or
        all that ``seq`` could take from the cache, so ``seq`` waits for them.

        Hashes chain, so another sequence whose hash at the last of those blocks is
        the same has the same blocks before it; one that registered block ``start``
        already is not computing it (the lookup would have found it).
        """
        bs = self.block_size
        limit = min(len(hashes), (len(seq.tokens) - 1) // bs)
        want = min(-(-self.join_min_tokens // bs), limit - start)
        if want <= 0:
            return False
        last = start + want - 1
        mine = hashes[last]
        for other in self.running:
            theirs = other.admit_hashes
            if theirs is None or other.num_registered > start or len(theirs) <= last:
                continue
            if theirs[last] == mine:
                return True
        return False

    def _partial(self, seq: Sequence, hashes: Any, num_hit: int) -> tuple[int, int] | None:
        """A cached block to copy the leading rows of ``seq``'s first uncached block
        from: (block id, rows), or None. Recurrent models get none (their state
        exists at block boundaries only)."""
        if self.states is not None:
            return None
        bs = self.block_size
        start = num_hit * bs
        limit = min(bs - 1, len(seq.tokens) - 1 - start)  # a token is always left to compute
        if limit < MIN_PARTIAL_ROWS:
            return None
        parent = self._parent_key(seq, hashes, num_hit)
        kids = self._by_parent.get(parent)
        if not kids:
            return None
        want = seq.hash_tokens(start, start + limit)
        found = []
        for child in kids:
            block, toks = self._sources[(parent, child)]
            k = 0
            for a, b in zip(want, toks, strict=False):
                if a != b:
                    break
                k += 1
            if k >= MIN_PARTIAL_ROWS:
                found.append((k, child, block))
        for k, child, block in sorted(found, reverse=True):
            if self.cache.block_hash(block) == child:  # still cached as that content
                self._sources.move_to_end((parent, child))
                return block, k
        return None

    def _parent_key(self, seq: Sequence, hashes: Any, index: int) -> Any:
        """What identifies the prefix before block ``index``: the hash of the block
        before it, or the salt for a first block."""
        return int(hashes[index - 1]) if index else ("salt", seq.prepared.salt)

    def _remember(self, seq: Sequence, hashes: Any, first: int, end: int) -> None:
        """Keep blocks ``first .. end - 1`` of ``seq`` (just registered) as partial-reuse
        sources: the newest :data:`PARTIAL_CHILDREN` per preceding block, and about
        as many in all as the pool has blocks."""
        if self.states is not None:
            return
        bs = self.block_size
        for i in range(first, end):
            parent, child = self._parent_key(seq, hashes, i), int(hashes[i])
            key = (parent, child)
            self._sources.pop(key, None)
            self._sources[key] = (seq.block_ids[i], tuple(seq.hash_tokens(i * bs, (i + 1) * bs)))
            kids = self._by_parent.setdefault(parent, {})
            kids.pop(child, None)
            kids[child] = None
            if len(kids) > PARTIAL_CHILDREN:
                self._forget((parent, next(iter(kids))))
        while len(self._sources) > max(256, self.pool.num_blocks):
            self._forget(next(iter(self._sources)))

    def _forget(self, key: tuple[Any, int]) -> None:
        self._sources.pop(key, None)
        kids = self._by_parent.get(key[0])
        if kids is not None:
            kids.pop(key[1], None)
            if not kids:
                del self._by_parent[key[0]]

    def _disk_plan(self, hashes: Any, hit: list[int], limit: int) -> tuple[int, int]:
        """What to read from the disk tier for a prefix whose resident hit is ``hit``:
        (blocks past the hit, and the length of a state snapshot to load with them,
        0 for none). A recurrent model reads only blocks its longest snapshot (in
        memory or on disk) covers: past it, its KV is of no use without the state."""
        assert self.disk is not None
        k = self.disk.run_length(hashes, len(hit), limit)
        if self.states is None:
            return k, 0
        found = self.states.find(hashes, hit, self.cache) if hit else None
        resident = found.num_blocks if found is not None else 0
        on_disk = self.disk.best_snapshot(hashes, resident, len(hit) + k)
        reach = max(resident, on_disk)
        return max(0, min(k, reach - len(hit))), (on_disk if on_disk > resident else 0)

    def _allocate(self, n: int) -> list[int] | None:
        """``pool.allocate(n)``; with a disk tier, the cached blocks it is about to evict
        (the head of the free list) are handed to ``on_evict`` first; with KV events,
        the hashes of the cached blocks it handed out are reported removed."""
        if self.on_evict is not None and 0 < n <= self.pool.num_free_blocks:
            head = self.pool.free_list()[:n]
            victims = [(b, h) for b in head if (h := self.cache.block_hash(b)) is not None]
            if victims:
                self.on_evict(victims)
        new: list[int] | None = self.pool.allocate(n)
        if new is not None and self.events is not None and self._stored_ids:
            gone = [h for b in new if (h := self._stored_ids.pop(b, None)) is not None]
            if gone:
                self.events.removed(gone)
        return new

    def events_cleared(self) -> None:
        """The pool and cache were rebuilt empty: report every block gone."""
        self._stored_ids.clear()
        if self.events is not None:
            self.events.cleared()

    def _grow(self, seq: Sequence, n: int, plan: PlanBuilder) -> bool:
        """Make ``seq``'s blocks cover ``n`` more tokens, preempting the youngest if needed.

        Returns False when ``seq`` itself had to be preempted.
        """
        need = self.blocks_needed(seq.num_computed + n) - len(seq.block_ids)
        while need > 0:
            new = self._allocate(need)
            if new is not None:
                seq.block_ids.extend(new)
                return True
            victim = self.running[-1]
            self.preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence, plan: PlanBuilder | None = None) -> None:
        """Free ``seq``'s blocks and requeue it for recomputation."""
        self.running.remove(seq)
        self._release(seq)
        seq.disk_tried = False  # its blocks may be on disk by the time it comes back
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if plan is not None:
            plan.discard(seq)
        self.add(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed = 0
        seq.num_registered = 0
        seq.admit_hashes = None  # claims nothing while it waits
        if self.states is not None:
            for slot in (seq.state_slot, seq.boundary_slot, seq.plan_snapshot):
                self.states.release(slot)
            for _, slot in seq.pending_snapshots:
                self.states.release(slot)
        seq.state_slot = seq.boundary_slot = seq.plan_snapshot = seq.state_read = 0
        seq.boundary_blocks = 0
        seq.pending_snapshots = []

    # ------------------------------------------------------------ recurrent state

    def _state_hit(self, seq: Sequence, hashes: Any, hit: list[int]) -> list[int]:
        """For a recurrent model: the part of a prefix hit it can use (up to its longest
        snapshot; the rest is given back), and the sequence's state slots (none when
        fewer than two are free)."""
        assert self.states is not None
        snap = self.states.find(hashes, hit, self.cache) if hit else None
        keep = snap.num_blocks if snap is not None else 0
        # Where this prompt leaves the cached prefix is a branch point: the
        # next request sharing the prefix likely leaves it there too.
        seq.branch_blocks = len(hit) if len(hit) > keep else 0
        seq.hit_ids = hit
        if len(hit) > keep:
            self.pool.free(hit[keep:])
            hit = hit[:keep]
        if self.states.num_free >= 2:
            seq.state_slot = self.states.allocate() or 0
            seq.boundary_slot = self.states.allocate() or 0
            seq.state_read = snap.slot if snap is not None else 0
        return hit

    def _unadmit(self, seq: Sequence, hit: list[int]) -> None:
        """Undo a failed admission: the lookup's references, the state slots."""
        if hit:
            self.pool.free(hit)
        self._release(seq)

    def _take(self, remaining: int, budget: int) -> int:
        """Prompt tokens to prefill now, of ``remaining``, with ``budget`` left in the step.

        All of them when what would be left is a sliver (at most an eighth of the
        step budget): a burst of prompts then does not leave a later step a
        few-token chunk, which costs a forward call of its own (a read of every
        weight) next to that step's decode call.
        """
        if remaining - budget <= self.step_token_budget // TAIL_FRACTION:
            return remaining
        return min(remaining, budget)

    def _chunk(self, seq: Sequence, n: int) -> int:
        """Cut a prefill chunk of ``n`` tokens at the next snapshot point, and plan the
        snapshot there when none is stored yet (recurrent models; else ``n``)."""
        if self.states is None or not seq.state_slot:
            return n
        bs = self.block_size
        start = seq.num_computed
        seq.plan_snapshot = self._release_snapshot(seq.plan_snapshot)
        turn = (seq.prepared.last_user_at or 0) // bs
        for point in self.states.points(seq.num_prompt, bs, seq.branch_blocks, turn):
            end = point * bs
            if end <= start:
                continue
            if end > start + n:
                break
            if not self.states.has(int(self._hashes(seq, point)[point - 1])):
                seq.plan_snapshot = self.states.allocate() or 0
            return end - start
        return n

    def _keep_snapshot(self, seq: Sequence, nb: int, slot: int) -> None:
        """Store ``slot`` (the state after ``seq``'s first ``nb`` blocks) under the hash of
        block ``nb - 1``, tied to the block the prefix cache keeps for that hash: its
        own, or — for a prefix it computed again past a shorter snapshot — the block
        its lookup found (a hash that is cached already keeps its first block)."""
        assert self.states is not None
        h = int(self._hashes(seq, nb)[nb - 1])
        mine = seq.block_ids[nb - 1]
        found = seq.hit_ids[nb - 1] if nb <= len(seq.hit_ids) else mine
        for bid in (mine, found):
            if self.cache.block_hash(bid) == h:
                self.states.add(h, bid, nb, slot)
                return
        self.states.release(slot)

    def _release_snapshot(self, slot: int) -> int:
        if slot and self.states is not None:
            self.states.release(slot)
        return 0

    # ------------------------------------------------------------ after a step

    def register(self, seq: Sequence) -> None:
        """Register ``seq``'s newly full blocks whose token ids are known (as each step
        is launched, and as sampled tokens are read back).

        Blocks still being written by a step in flight may be registered: any
        later reader's graph is ordered after those writes (every pool update
        replaces the array the next step's graph reads), and a step that fails
        either leaves its writes done or gets the pools rebuilt
        (``Engine._recover_pools``).
        """
        full = min(seq.num_computed, len(seq.tokens)) // self.block_size
        if full > seq.num_registered:
            h = self._hashes(seq, full)
            if len(h) > full:  # recomputing after preemption: the kept chain runs ahead
                h = self.cache.hash_blocks(
                    seq.hash_tokens(0, full * self.block_size), salt=seq.prepared.salt
                )
            self.cache.insert(h, seq.block_ids[:full])
            if self.events is not None:
                self.publish_stored(seq, h, seq.block_ids, seq.num_registered, full)
            self._remember(seq, h, seq.num_registered, full)
            seq.num_registered = full
        if seq.pending_snapshots and self.states is not None:
            ready = [(nb, slot) for nb, slot in seq.pending_snapshots if nb <= seq.num_registered]
            seq.pending_snapshots = [x for x in seq.pending_snapshots if x[0] > seq.num_registered]
            for nb, slot in ready:
                self._keep_snapshot(seq, nb, slot)

    def publish_stored(
        self, seq: Sequence, hashes: Any, block_ids: list[int], first: int, end: int
    ) -> None:
        """Report blocks ``first .. end - 1`` of ``seq`` (``block_ids``, just inserted)
        that joined the cache as KV events: one ``stored`` per run of consecutive
        blocks. A block whose content was cached elsewhere already stays out of the
        cache (``PrefixCache.insert``) and was reported when that one joined."""
        bs = self.block_size
        run: list[int] = []
        for i in range(first, end + 1):
            if i < end and self.cache.block_hash(block_ids[i]) == (h := int(hashes[i])):
                self._stored_ids[block_ids[i]] = h
                run.append(i)
                continue
            if run:
                a, b = run[0], run[-1] + 1
                self.events.stored(
                    [int(hashes[j]) for j in run],
                    int(hashes[a - 1]) if a else None,
                    seq.tokens[a * bs : b * bs],
                    bs,
                )
                run = []

    def _hashes(self, seq: Sequence, num_blocks: int) -> Any:
        """``seq``'s kept block hashes, extended by its next full blocks up to ``num_blocks``."""
        bs = self.block_size
        h = seq.block_hashes
        if h is None:
            h = seq.block_hashes = self.cache.hash_blocks([], salt=seq.prepared.salt)
        if len(h) < num_blocks:
            h = seq.block_hashes = self.cache.hash_blocks(
                seq.hash_tokens(len(h) * bs, num_blocks * bs), prefix=h
            )
        return h

    def finish(self, seq: Sequence) -> None:
        """A sequence completed: free its blocks (full ones stay cached); a recurrent
        model keeps the state after its last full block as a snapshot."""
        nb = seq.boundary_blocks
        if (
            self.states is not None
            and seq in self.running
            and seq.boundary_slot
            and 0 < nb <= seq.num_registered
        ):
            self._keep_snapshot(seq, nb, seq.boundary_slot)
            seq.boundary_slot = 0
        self.remove(seq)
