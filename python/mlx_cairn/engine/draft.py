"""A draft model for speculative decoding: a small model with the model's tokenizer, run
on its own paged KV pools that share the block tables of the model's.

The draft's pools have the same number of blocks and block size as the model's,
and a sequence's draft KV for position p lives in the same block id as its
model KV for p. So the block allocator, preemption and the prefix cache need
nothing of their own: a prefix hit's blocks hold the draft KV of those tokens
too (written by the request that computed them; if that request did not draft,
the drafts of a later one are worse, never its output, which verification
keeps exact).

Each step with verify rows of draft-model requests runs, before the model's
forward pass (engine/core.py)::

    catch-up   tokens[c : L] per row, c = the draft's first stale position
               (the prompt at first, then what the last verify accepted)
    draft 1..K greedy, one token per row and call, fed lazily to the next call
    read back  the K drafts of every row (one wait)

Drafts are greedy: a proposal that puts all its mass on one token, which is
what :func:`mlx_cairn.engine.speculate.verify` checks exactly, greedy or sampled.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_cairn.engine.paged import KVPools, PagedKVCache
from mlx_cairn.engine.plan import RowPlan

#: Longest catch-up chunk per draft call (a long prompt is taken in several).
CATCH_UP_CHUNK = 512


class DraftModel:
    """Proposes each verify row's draft with a small model (engine thread only)."""

    def __init__(self, loaded: Any, pools: KVPools) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.pools = pools

    def propose(self, rows: list[RowPlan]) -> list[tuple[int, ...]]:
        """Drafts for ``rows`` (verify rows planned with ``len(r.draft)`` draft slots)."""
        if not rows:
            return []
        seqs = [r.seq for r in rows]
        known = [len(s.tokens) for s in seqs]
        starts = [min(s.spec.draft_computed, n - 1) for s, n in zip(seqs, known, strict=True)]
        # Catch-up: every row feeds its stale tokens; the last chunk's logits give draft 1.
        logits: list[mx.array | None] = [None] * len(rows)
        pos = list(starts)
        h: mx.array | None = None  # the last catch-up chunk's hidden states
        while True:
            todo = [b for b in range(len(rows)) if pos[b] < known[b]]
            if not todo:
                break
            if h is not None:
                self.pools.queue_call(h)  # the last chunk first (KVPools.queue_call)
            lens = [min(CATCH_UP_CHUNK, known[b] - pos[b]) for b in todo]
            width = max(lens)
            ids = [
                seqs[b].tokens[pos[b] : pos[b] + n] + [0] * (width - n)
                for b, n in zip(todo, lens, strict=True)
            ]
            cache = PagedKVCache(
                self.pools,
                [list(rows[b].block_ids) for b in todo],
                [pos[b] for b in todo],
                lens,
                None,
            )
            h = self.model(mx.array(ids, dtype=mx.int32), cache)
            cache.commit()
            for j, (b, n) in enumerate(zip(todo, lens, strict=True)):
                pos[b] += n
                if pos[b] == known[b]:
                    logits[b] = h[j, n - 1]
        first = mx.argmax(self.model.logits(mx.stack(logits)), axis=-1)  # type: ignore[arg-type]
        drafts: list[list[mx.array]] = [[first[b]] for b in range(len(rows))]
        k_max = max(len(r.draft) for r in rows)
        for j in range(1, k_max):
            live = [b for b, r in enumerate(rows) if len(r.draft) > j]
            if not live:
                break
            cache = PagedKVCache(
                self.pools,
                [list(rows[b].block_ids) for b in live],
                [known[b] + j - 1 for b in live],
                1,
                None,
            )
            fed = mx.stack([drafts[b][-1] for b in live]).astype(mx.int32)[:, None]
            h = self.model(fed, cache)
            cache.commit()
            nxt = mx.argmax(self.model.logits(h[:, -1, :]), axis=-1)
            for i, b in enumerate(live):
                drafts[b].append(nxt[i])
        flat = mx.stack([t for d in drafts for t in d])
        mx.eval(flat, self.pools.arrays())
        values: list[int] = flat.tolist()  # type: ignore[assignment]
        out: list[tuple[int, ...]] = []
        i = 0
        for b, r in enumerate(rows):
            k = len(r.draft)
            out.append(tuple(values[i : i + k]))
            i += len(drafts[b])
            # Fed: every known token and drafts 1..k-1 (their KV is right if accepted).
            seqs[b].spec.draft_computed = known[b] + k - 1
        return out


def same_vocabulary(a: Any, b: Any) -> bool:
    """Whether two loaded models' tokenizers map every token to the same id."""
    ta, tb = a.tokenizer, b.tokenizer
    if ta.vocab_size != tb.vocab_size:
        return False
    return bool(ta.hf.get_vocab(with_added_tokens=True) == tb.hf.get_vocab(with_added_tokens=True))
