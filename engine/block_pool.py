"""A torch-free pool of KV-cache blocks with reference counts and prefix caching.

Blocks are integer ids. A block is in exactly one of three states:

- free:      ref_count == 0, no hash, in the free list;
- in use:    ref_count > 0 (shared blocks have ref_count > 1);
- cached:    ref_count == 0 but its hash is registered, so a later request with
             the same prefix can reuse its contents. Cached blocks are evicted
             least-recently-freed first when the free list runs dry.

A full block's hash chains the hash of the block before it with its own token
ids, so equal hashes mean equal prefixes (up to a 64-bit blake2b collision).
"""
from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised by allocate() when fewer blocks are available than asked for."""


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", -1 if parent_hash is None else parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return struct.unpack("<q", h.digest())[0]


def compute_block_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int | None = None) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids``."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start:start + block_size])
        hashes.append(parent_hash)
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields low ids first
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; LRU order
        self._hash_to_block: dict[int, int] = {}
        self.num_cache_hits = 0
        self.num_cache_queries = 0

    # ---- queries -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate() can hand out now (free plus evictable cached)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def is_fully_free(self) -> bool:
        return self.num_free_blocks == self.num_blocks and not any(self.ref_counts)

    def cached_hashes(self) -> set[int]:
        return set(self._hash_to_block)

    # ---- allocation ----------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks with ref_count 1, evicting cached blocks LRU if needed."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._cached_free.popitem(last=False)
                self._uncache(b)
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def fork(self, block_ids: Sequence[int]) -> None:
        """Add a reference to blocks already in use (sharing them)."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"fork of block {b} which is not in use")
        for b in block_ids:
            self.ref_counts[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. Freed blocks with a hash stay cached.

        Blocks are released in reverse so that a sequence's tail is evicted
        before its head (its head is the more shareable prefix).
        """
        for b, n in Counter(block_ids).items():
            if self.ref_counts[b] < n:
                raise ValueError(f"double free of block {b}")
        for b in reversed(block_ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self._cached_free[b] = None
                else:
                    self._free.append(b)

    # ---- prefix cache --------------------------------------------------
    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Register a full, written block under its chained hash. The block
        must be in use: a free block's contents may be overwritten at any time."""
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"cache_block of block {block_id} which is not in use")
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self._hash_to_block:
            return  # an identical block is already cached; keep the first
        self.block_hash[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id

    def lookup_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix, without taking references."""
        hits = []
        if self.enable_prefix_caching:
            for h in block_hashes:
                b = self._hash_to_block.get(h)
                if b is None:
                    break
                hits.append(b)
        return hits

    def acquire_cached(self, block_ids: Sequence[int]) -> None:
        """Take a reference on blocks returned by lookup_prefix() (and not
        evicted since: call it before any allocate())."""
        for b in block_ids:
            if self.block_hash[b] is None:
                raise ValueError(f"acquire_cached of block {b} which is not in the prefix cache")
        self.num_cache_queries += 1
        self.num_cache_hits += len(block_ids)
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self._cached_free[b]
            self.ref_counts[b] += 1

    def _uncache(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            del self._hash_to_block[h]
            self.block_hash[b] = None

    def reset_prefix_cache(self) -> None:
        for b in list(self._cached_free):
            self._uncache(b)
            self._free.append(b)
        self._cached_free.clear()
