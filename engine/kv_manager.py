"""Per-sequence block bookkeeping on top of the BlockPool: at admission a
fork of a sibling's prompt blocks or a prefix-cache match, growth as tokens
are scheduled, caching of blocks as they fill, and release."""
from __future__ import annotations

from engine.block_pool import BlockPool, hash_block
from engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            j = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, seq.tokens_slice(j * bs, (j + 1) * bs)))

    def admit(self, seq: Sequence) -> bool:
        """For a sequence holding no blocks: the blocks it can reuse. A fork
        (``seq.fork_of``, choice j > 0 of a request with n > 1) shares its
        sibling's full prompt blocks, reference-counted, once the sibling has
        computed them: the sequence then computes only the prompt's last
        partial block (at least its last token, to sample from), into blocks of
        its own, and never writes into a shared one. Returns False while the
        sibling is still computing them (try again next step)."""
        parent = seq.fork_of
        num_shared = (seq.num_tokens - 1) // self.block_size
        if parent is None or num_shared == 0 or not parent.block_ids:
            self.match_prefix(seq)  # a sibling gone or preempted: the prefix cache may still hold its blocks
            return True
        if parent.num_computed_tokens < num_shared * self.block_size:
            if parent.is_finished:  # it will compute no more
                self.match_prefix(seq)
                return True
            return False
        # a sibling still holding its blocks, finished or not (a prefill-only one keeps them while they are sent)
        shared = parent.block_ids[:num_shared]
        self.pool.fork(shared)
        seq.block_ids = list(shared)
        seq.num_computed_tokens = seq.num_prefix_hit_tokens = num_shared * self.block_size
        return True

    def match_prefix(self, seq: Sequence) -> int:
        """For a sequence holding no blocks: take the longest cached prefix.

        At least one token is always left to compute, so the forward pass has a
        position to sample from; and a sequence that asked for its prompt's
        logprobs reuses no position whose logits it still needs. Returns the
        number of tokens reused.
        """
        if seq.block_ids or not self.pool.enable_prefix_caching:
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if seq.prompt_logprobs_pending:
            max_blocks = min(max_blocks, len(seq.prompt_logprobs) // self.block_size)
        self._extend_hashes(seq, max_blocks)
        hits = self.pool.lookup_prefix(seq.block_hashes[:max_blocks])
        self.pool.acquire_cached(hits)
        seq.block_ids = list(hits)
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_prefix_hit_tokens = seq.num_computed_tokens
        return seq.num_computed_tokens

    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - len(seq.block_ids))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pool.can_allocate(self.num_blocks_needed(seq, num_tokens))

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens in total; False if the pool is short."""
        n = self.num_blocks_needed(seq, num_tokens)
        if not self.pool.can_allocate(n):
            return False
        seq.block_ids.extend(self.pool.allocate(n))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block that is now full of computed tokens."""
        if not self.pool.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        self._extend_hashes(seq, num_full)
        for j in range(seq.num_cached_blocks, num_full):
            self.pool.cache_block(seq.block_ids[j], seq.block_hashes[j])
        seq.num_cached_blocks = num_full

    def free(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.num_cached_blocks = 0
