"""Property tests of BlockPool and KVCacheManager: any sequence of operations
keeps the books straight (hypothesis rule-based state machines against a
plain model of who holds which block)."""
from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from engine.block_pool import BlockPool, NoFreeBlocksError, compute_block_hashes
from engine.kv_manager import KVCacheManager
from engine.sampling import SamplingParams
from engine.sequence import Sequence

NUM_BLOCKS = 12
BLOCK_SIZE = 4
SETTINGS = settings(max_examples=300, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class PoolMachine(RuleBasedStateMachine):
    """Holders each own one reference on each of their blocks; the pool's
    reference counts must equal the model's count of holders."""

    holders = Bundle("holders")

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.held: dict[int, list[int]] = {}  # holder -> blocks
        self.hash_of: dict[int, int] = {}  # block -> registered hash (model)
        self.next_holder = 0

    def _new_holder(self, blocks: list[int]) -> int:
        h = self.next_holder
        self.next_holder += 1
        self.held[h] = list(blocks)
        return h

    def _refs(self) -> Counter:
        return Counter(b for blocks in self.held.values() for b in blocks)

    @rule(target=holders, n=st.integers(0, NUM_BLOCKS + 2))
    def allocate(self, n):
        refs = self._refs()
        if n > NUM_BLOCKS - len(refs):
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return self._new_holder([])
        blocks = self.pool.allocate(n)
        assert len(set(blocks)) == n, "a block handed out twice in one allocation"
        assert not set(blocks) & set(refs), "a block in use was handed out again"
        for b in blocks:  # evicted cached blocks lose their hash
            self.hash_of.pop(b, None)
        return self._new_holder(blocks)

    @rule(target=holders, h=holders)
    def fork(self, h):
        if h not in self.held:
            return self._new_holder([])
        blocks = self.held[h]
        self.pool.fork(blocks)
        return self._new_holder(blocks)

    @rule(h=consumes(holders))
    def free(self, h):
        blocks = self.held.pop(h, None)
        if blocks is not None:
            self.pool.free(blocks)

    @rule(b=st.integers(0, NUM_BLOCKS - 1))
    def free_unheld_block_raises(self, b):
        if b in self._refs():
            return
        before = list(self.pool.ref_counts)
        with pytest.raises(ValueError, match="double free"):
            self.pool.free([b])
        assert self.pool.ref_counts == before

    @rule(h=holders)
    def free_same_block_twice_in_one_call_raises(self, h):
        blocks = self.held.get(h)
        if not blocks:
            return
        b = blocks[0]
        if self._refs()[b] != 1:
            return
        before = list(self.pool.ref_counts)
        with pytest.raises(ValueError, match="double free"):
            self.pool.free([b, b])
        assert self.pool.ref_counts == before

    @rule(b=st.integers(0, NUM_BLOCKS - 1))
    def fork_unheld_block_raises(self, b):
        if b in self._refs():
            return
        with pytest.raises(ValueError):
            self.pool.fork([b])

    @rule(h=holders, i=st.integers(0, NUM_BLOCKS), block_hash=st.integers(0, 7))
    def cache(self, h, i, block_hash):
        blocks = self.held.get(h)
        if not blocks:
            return
        b = blocks[i % len(blocks)]
        self.pool.cache_block(b, block_hash)
        if b not in self.hash_of and block_hash not in self.hash_of.values():
            self.hash_of[b] = block_hash

    @rule(b=st.integers(0, NUM_BLOCKS - 1), block_hash=st.integers(0, 7))
    def cache_unheld_block_raises(self, b, block_hash):
        if b in self._refs():
            return
        with pytest.raises(ValueError):
            self.pool.cache_block(b, block_hash)

    @rule(target=holders, hashes=st.lists(st.integers(0, 7), max_size=5))
    def lookup_and_acquire(self, hashes):
        hits = self.pool.lookup_prefix(hashes)
        block_of = {v: k for k, v in self.hash_of.items()}
        expected = []
        for x in hashes:
            if x not in block_of:
                break
            expected.append(block_of[x])
        assert hits == expected
        for x, b in zip(hashes, hits):
            assert self.pool.block_hash[b] == x
        self.pool.acquire_cached(hits)
        return self._new_holder(hits)

    @rule(b=st.integers(0, NUM_BLOCKS - 1))
    def acquire_uncached_block_raises(self, b):
        if b in self.hash_of:
            return
        with pytest.raises(ValueError):
            self.pool.acquire_cached([b])

    @rule()
    def reset_prefix_cache(self):
        self.pool.reset_prefix_cache()
        refs = self._refs()
        self.hash_of = {b: x for b, x in self.hash_of.items() if b in refs}

    @invariant()
    def books_balance(self):
        refs = self._refs()
        assert self.pool.ref_counts == [refs.get(b, 0) for b in range(NUM_BLOCKS)]
        assert self.pool.num_free_blocks == NUM_BLOCKS - len(refs)
        assert self.pool.num_used_blocks == len(refs)
        assert {b: x for b, x in enumerate(self.pool.block_hash) if x is not None} == self.hash_of
        assert self.pool.cached_hashes() == set(self.hash_of.values())

    def teardown(self):
        for blocks in self.held.values():
            self.pool.free(blocks)
        assert self.pool.is_fully_free()
        self.pool.reset_prefix_cache()
        assert self.pool.num_cached_blocks == 0 and self.pool.is_fully_free()


TestBlockPool = PoolMachine.TestCase
TestBlockPool.settings = SETTINGS


class KVManagerMachine(RuleBasedStateMachine):
    """Sequences over a small alphabet (so prefixes are shared) are admitted
    with prefix matching, computed chunk by chunk, decoded and aborted. The
    model records what each block holds as it is written; a prefix-cache hit
    must hand back blocks holding exactly the sequence's tokens, and nothing
    is ever written into a block someone else can read."""

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.kv = KVCacheManager(self.pool, BLOCK_SIZE)
        self.live: dict[str, Sequence] = {}
        self.content: dict[int, list[int | None]] = {}  # block -> tokens written at each offset
        self.n = 0

    @rule(target=seqs, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def admit(self, tokens):
        seq = Sequence(f"s{self.n}", tokens, SamplingParams(temperature=0.0))
        self.n += 1
        self.kv.match_prefix(seq)
        assert seq.num_computed_tokens < seq.num_tokens
        assert seq.num_computed_tokens == len(seq.block_ids) * BLOCK_SIZE
        bs = BLOCK_SIZE
        for j, b in enumerate(seq.block_ids):
            assert self.content[b] == tokens[j * bs:(j + 1) * bs], "prefix hit on a block holding other tokens"
        self.live[seq.request_id] = seq
        return seq

    @rule(seq=seqs, chunk=st.integers(1, 9))
    def compute(self, seq, chunk):
        if seq.request_id not in self.live:
            return
        start = seq.num_computed_tokens
        n = min(chunk, seq.num_tokens - start)
        if n <= 0:
            return
        if not self.kv.grow(seq, start + n):
            assert not self.kv.can_grow(seq, start + n)
            return
        assert len(seq.block_ids) * BLOCK_SIZE >= start + n
        refs = Counter(b for s in self.live.values() for b in s.block_ids)
        for p in range(start, start + n):
            b = seq.block_ids[p // BLOCK_SIZE]
            assert refs[b] == 1, f"writing into block {b}, which another sequence holds"
            assert self.pool.block_hash[b] is None, f"writing into cached block {b}"
            if p % BLOCK_SIZE == 0:
                self.content[b] = [None] * BLOCK_SIZE
            self.content[b][p % BLOCK_SIZE] = seq.token_at(p)
        seq.num_computed_tokens = start + n
        self.kv.cache_full_blocks(seq)

    @rule(seq=seqs, token=st.integers(0, 2))
    def decode(self, seq, token):
        if seq.request_id in self.live and seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(token)

    @rule(seq=consumes(seqs))
    def abort(self, seq):
        if self.live.pop(seq.request_id, None) is not None:
            self.kv.free(seq)
            assert seq.block_ids == []

    @invariant()
    def books_balance(self):
        refs = Counter(b for s in self.live.values() for b in s.block_ids)
        assert self.pool.ref_counts == [refs.get(b, 0) for b in range(NUM_BLOCKS)]
        assert self.pool.num_free_blocks == NUM_BLOCKS - len(refs)
        for s in self.live.values():
            assert len(set(s.block_ids)) == len(s.block_ids)
            full = s.num_computed_tokens // BLOCK_SIZE
            hashes = compute_block_hashes(s.token_ids[:full * BLOCK_SIZE], BLOCK_SIZE)
            for j in range(min(s.num_cached_blocks, full)):
                b = s.block_ids[j]
                assert self.pool.block_hash[b] in (None, hashes[j])
                assert self.content[b] == s.token_ids[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE]
        for b, h in enumerate(self.pool.block_hash):
            if h is not None:  # only full, written blocks are ever cached
                assert None not in self.content[b]

    def teardown(self):
        for s in self.live.values():
            self.kv.free(s)
        assert self.pool.is_fully_free()


TestKVCacheManager = KVManagerMachine.TestCase
TestKVCacheManager.settings = SETTINGS


def test_eviction_is_lru_and_spares_blocks_in_use():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for blk, h in zip((a, b, c), (10, 11, 12)):
        pool.cache_block(blk, h)
    pool.free([a])
    pool.free([c, b])  # freed in reverse: b is released before c
    assert pool.num_free_blocks == 3
    assert pool.allocate(1) == [a]  # least recently freed cached block goes first
    assert pool.lookup_prefix([11]) == [b] and pool.lookup_prefix([10]) == []
    assert pool.allocate(1) == [b] and pool.allocate(1) == [c]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free([a, b, c, d])
    assert pool.is_fully_free() and pool.num_cached_blocks == 0
