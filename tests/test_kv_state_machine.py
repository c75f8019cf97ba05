"""BlockPool + PrefixCache against a plain-Python model of the same semantics.

The model keys cached blocks by their full content (salt, tokens up to the end
of the block) instead of a hash, so it is obviously right; the machine checks
the Rust implementation against it after every step.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_cairn.kv import BlockPool, PrefixCache

BS = 3
NUM_BLOCKS = 14
Key = tuple[object, tuple[int, ...]]

# Prompts from a few shared stems so that prefixes collide often.
STEMS = [(1, 2, 3, 4, 5, 6), (1, 2, 3, 9, 9, 9), (7, 7, 7, 7, 7, 7, 7, 7, 7)]
prompts = st.tuples(
    st.sampled_from(STEMS), st.lists(st.integers(0, 3), max_size=7), st.integers(0, 9)
).map(lambda t: list(t[0][: t[2]]) + t[1])
salts = st.sampled_from([None, "a", b"b"])


class Model:
    """The semantics of issue 3, written as plainly as possible."""

    def __init__(self) -> None:
        self.ref = [0] * NUM_BLOCKS
        self.free = list(range(1, NUM_BLOCKS))  # head = next to allocate
        self.key_of: dict[int, Key] = {}  # block -> content it is cached as
        self.table: dict[Key, int] = {}
        self.evictions = 0

    @staticmethod
    def keys(tokens: list[int], salt: object) -> list[Key]:
        norm = salt.encode() if isinstance(salt, str) else salt
        return [(norm, tuple(tokens[: (i + 1) * BS])) for i in range(len(tokens) // BS)]

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = self.free[:n]
        del self.free[:n]
        for b in out:
            if b in self.key_of:
                del self.table[self.key_of.pop(b)]
                self.evictions += 1
            self.ref[b] = 1
        return out

    def free_ok(self, ids: list[int]) -> bool:
        need = Counter(ids)
        return all(0 < b < NUM_BLOCKS and self.ref[b] >= k for b, k in need.items())

    def release(self, ids: list[int]) -> None:
        for b in reversed(ids):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)

    def lookup(self, tokens: list[int], salt: object) -> list[int]:
        limit = max(len(tokens) - 1, 0) // BS
        out = []
        for key in self.keys(tokens, salt)[:limit]:
            b = self.table.get(key)
            if b is None:
                break
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
            out.append(b)
        return out

    def insert_ok(self, keys: list[Key], ids: list[int]) -> bool:
        if len(ids) < len(keys):
            return False
        ids = ids[: len(keys)]
        if len(set(ids)) != len(ids):
            return False
        for key, b in zip(keys, ids, strict=True):
            if not (0 < b < NUM_BLOCKS) or self.ref[b] == 0:
                return False
            if b in self.key_of and self.key_of[b] != key:
                return False
        return True

    def insert(self, keys: list[Key], ids: list[int]) -> int:
        added = 0
        for key, b in zip(keys, ids, strict=False):
            if b in self.key_of or key in self.table:
                continue
            self.table[key] = b
            self.key_of[b] = key
            added += 1
        return added


class KvMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BS)
        self.cache = PrefixCache(self.pool, seed=1234)
        self.model = Model()
        self.held: list[list[int]] = []  # every reference the test holds

    def _tokens(self, tokens: list[int], as_array: bool) -> object:
        return np.asarray(tokens, dtype=np.int32) if as_array else tokens

    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, n: int) -> None:
        got = self.pool.allocate(n)
        assert got == self.model.allocate(n)
        if got:
            self.held.append(got)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_held(self, data: st.DataObject) -> None:
        ids = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.free(ids)
        self.model.release(ids)

    @rule(ids=st.lists(st.integers(-1, NUM_BLOCKS), max_size=4))
    def free_arbitrary(self, ids: list[int]) -> None:
        """Frees that may be wrong: must raise and change nothing, or match the model."""
        if self.model.free_ok(ids):
            # Valid only if the test really holds these references: take them from `held`.
            pool_refs = Counter(b for h in self.held for b in h)
            if any(pool_refs[b] < k for b, k in Counter(ids).items()):
                return
            for b in ids:
                for h in self.held:
                    if b in h:
                        h.remove(b)
                        break
            self.held = [h for h in self.held if h]
            self.pool.free(ids)
            self.model.release(ids)
        else:
            before = self.pool.free_list()
            try:
                self.pool.free(ids)
            except ValueError:
                pass
            else:
                raise AssertionError(f"free({ids}) should have failed")
            assert self.pool.free_list() == before

    @rule(
        tokens=prompts,
        salt=salts,
        as_array=st.booleans(),
        use_handle=st.booleans(),
        split=st.integers(0, 5),
    )
    def lookup(
        self, tokens: list[int], salt: object, as_array: bool, use_handle: bool, split: int
    ) -> None:
        arg = self._tokens(tokens, as_array)
        if use_handle:
            # Hash in two pieces, the second continuing the first.
            cut = min(split, len(tokens) // BS) * BS
            head = self.cache.hash_blocks(tokens[:cut], salt)  # type: ignore[arg-type]
            h = self.cache.hash_blocks(arg[cut:], prefix=head)  # type: ignore[index]
            got = self.cache.lookup(h)
        else:
            got = self.cache.lookup(arg, salt)  # type: ignore[arg-type]
        assert got == self.model.lookup(tokens, salt)
        if got:
            self.held.append(got)

    @rule(tokens=prompts, salt=salts, data=st.data())
    def insert(self, tokens: list[int], salt: object, data: st.DataObject) -> None:
        """Insert into held blocks, or into arbitrary (possibly wrong) ids."""
        keys = self.model.keys(tokens, salt)
        if self.held and data.draw(st.booleans()):
            ids = self.held[data.draw(st.integers(0, len(self.held) - 1))]
        else:
            ids = data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=4))
        if self.model.insert_ok(keys, ids):
            assert self.cache.insert(tokens, ids, salt) == self.model.insert(keys, ids)
        else:
            before = self.pool.free_list(), self.cache.stats()
            try:
                self.cache.insert(tokens, ids, salt)
            except ValueError:
                pass
            else:
                raise AssertionError(f"insert into {ids} should have failed")
            assert (self.pool.free_list(), self.cache.stats()) == before

    @rule(tokens=prompts, salt=salts)
    def request(self, tokens: list[int], salt: object) -> None:
        """The engine's cycle: lookup, allocate the rest, insert, hold."""
        h = self.cache.hash_blocks(tokens, salt)
        hit = self.cache.lookup(h)
        assert hit == self.model.lookup(tokens, salt)
        need = -(-len(tokens) // BS) - len(hit)
        new = self.pool.allocate(need)
        assert new == self.model.allocate(need)
        if new is None:
            self.pool.free(hit)
            self.model.release(hit)
            return
        ids = hit + new
        keys = self.model.keys(tokens, salt)
        assert self.cache.insert(h, ids) == self.model.insert(keys, ids)
        if ids:
            self.held.append(ids)

    @invariant()
    def matches_model(self) -> None:
        m = self.model
        self.pool.check_invariants()
        st_ = self.cache.stats()
        assert st_["blocks_free"] + st_["blocks_in_use"] == st_["blocks_total"] == NUM_BLOCKS - 1
        # Refcounts equal the references held.
        held = Counter(b for h in self.held for b in h)
        refs = [self.pool.refcount(b) for b in range(NUM_BLOCKS)]
        assert refs == [held.get(b, 0) for b in range(NUM_BLOCKS)] == m.ref
        # No block is both free and referenced; eviction order matches the model.
        free = self.pool.free_list()
        assert free == m.free
        assert not set(free) & set(held)
        assert self.pool.num_free_blocks == len(free) == st_["blocks_free"]
        # Every cached hash describes its block's content.
        assert st_["blocks_cached"] == len(m.table)
        assert st_["evictions"] == m.evictions
        for b in range(NUM_BLOCKS):
            key = m.key_of.get(b)
            got = self.cache.block_hash(b)
            if key is None:
                assert got is None
            else:
                salt, toks = key
                assert got == self.cache.hash_blocks(list(toks), salt)[-1]


TestKvMachine = KvMachine.TestCase
