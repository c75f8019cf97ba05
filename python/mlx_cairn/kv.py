"""Paged KV bookkeeping: a block allocator and a content-addressed prefix cache.

The engine stores each sequence's keys and values in fixed-size blocks; this
module decides which block ids hold what (the arrays live elsewhere). Two
prompts that start with the same tokens share the same physical blocks::

    from mlx_cairn.kv import BlockPool, PrefixCache

    pool = BlockPool(num_blocks=1024, block_size=16)   # ids 1..1023; 0 is reserved
    cache = PrefixCache(pool, seed=None)                # random hash root per process

    h = cache.hash_blocks(prompt_ids, salt="tenant-a")  # hash once, reuse below
    hit = cache.lookup(h)                # cached prefix blocks, one reference each
    cached_tokens = len(hit) * pool.block_size
    need = -(-len(prompt_ids) // pool.block_size) - len(hit)
    new = pool.allocate(need)            # None: not enough free blocks (no partial grab)
    blocks = hit + new
    ...                                  # prefill tokens[cached_tokens:] into blocks
    cache.insert(h, blocks)              # register the full blocks
    pool.free(blocks)                    # done: blocks stay cached until re-allocated

While a sequence decodes, extend its hashes block by block instead of re-hashing
the whole prefix (``prefix`` must end on a block boundary)::

    h = cache.hash_blocks(tokens[:n_full * bs], salt="tenant-a")
    h = cache.hash_blocks(tokens[n_full * bs : (n_full + 1) * bs], prefix=h)
    cache.insert(h, seq_blocks)          # registers the newly full block

Semantics (docs/design.md §3):

- ``BlockPool.num_blocks`` counts block 0, which is never handed out.
- A block whose refcount drops to 0 goes to the tail of an LRU free list and keeps
  its hash, so ``lookup`` can still hit (and revive) it. ``allocate`` takes the
  least recently freed block and evicts its hash at that moment. ``free(ids)``
  releases in reverse order, so a sequence's chain is evicted from its end.
- Block hashes are chained xxh3-128 digests: block i covers block i-1's hash and
  its own token ids; the salt (for instance a model or tenant identity) goes into
  the first block. Only full blocks are hashed or registered.
- ``lookup`` never covers the whole prompt: at most ``(len - 1) // block_size``
  blocks are returned, so at least one token is always computed.
- ``insert`` is idempotent; a block whose content is already cached elsewhere
  stays uncached. The caller must hold a reference on each registered block.
- Token ids are a list/tuple of ints or a 1-D integer buffer (``numpy`` int32,
  ``array.array('i')``; other integer widths are accepted), each in ``0..2**31``.
- Bad input (unknown ids, double frees, a free block in ``insert``, huge numbers)
  raises ``ValueError``/``TypeError`` and leaves the state unchanged. Running out
  of blocks is ``None`` from ``allocate``, not an exception.
- Hashing of long prompts runs with the GIL released. A pool and the caches built
  on it share one internal lock, so they may be used from several threads.

``PrefixCache.stats()`` returns ``blocks_total`` (usable blocks, ``num_blocks - 1``),
``blocks_free``, ``blocks_in_use``, ``blocks_cached``, ``lookups``, ``hit_tokens``,
``miss_tokens`` and ``evictions``; ``blocks_free + blocks_in_use == blocks_total``.
"""

from __future__ import annotations

from mlx_cairn._core import BlockHashes, BlockPool, PrefixCache

__all__ = ["BlockHashes", "BlockPool", "PrefixCache"]
