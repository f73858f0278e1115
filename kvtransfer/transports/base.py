"""The sender-side interface every transport implements."""
from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from concurrent.futures import Future

import torch

from kvtransfer import slabs
from kvtransfer.config import SenderConfig
from kvtransfer.planner import ChunkPlan, contiguous_runs
from kvtransfer.types import Ack


class Link(ABC):
    """One authenticated connection from a sender to one receiver endpoint.

    Every method is nonblocking and returns a Future[Ack] that resolves when
    the receiver answered (or with Ack(ok=False) on a transport error; it
    never raises). A link whose transport broke sets ``is_broken`` and is
    replaced by a fresh one on the next transfer.
    """

    is_broken: bool = False
    peer_fingerprint: dict[str, str] | None = None  # the receiver's (its KV layout included), from the handshake

    @classmethod
    @abstractmethod
    def connect(cls, endpoint: str, fingerprint: dict[str, str], config: SenderConfig) -> "Link":
        """Open and authenticate a link (blocking, up to ``config.connect_timeout_s``).

        Raises HandshakeError when the receiver refuses (secret, fingerprint), TransferError when it
        cannot be reached.
        """

    @abstractmethod
    def send_chunk(self, transfer_id: str, chunk: ChunkPlan, src: list[torch.Tensor], src_block_ids: list[int],
                   checksum: bool) -> Future:
        """Send ``chunk``: its layers x ``src_block_ids[chunk.first_block:+chunk.num_blocks]`` x its KV heads,
        read from rank ``chunk.src_rank``.

        src: rank -> GLOBAL layer id -> ``[num_blocks, 2 * block_size, heads, head_bytes]`` uint8
        (``slabs.rank_views`` by ``KVLayout.global_layers``; None where a pipeline rank does not hold the layer).
        """

    @abstractmethod
    def commit(self, transfer_id: str, first_token: int) -> Future: ...

    @abstractmethod
    def abort(self, transfer_id: str, reason: str) -> Future: ...

    @abstractmethod
    def renew(self, transfer_id: str, lease_s: float) -> Future: ...

    def close(self) -> None:
        pass


def done(ack: Ack) -> Future:
    f: Future = Future()
    f.set_result(ack)
    return f


def chunk_ids(chunk: ChunkPlan, src_block_ids: list[int]) -> list[int]:
    return src_block_ids[chunk.first_block:chunk.first_block + chunk.num_blocks]


def chunk_heads(src: list[list[torch.Tensor]], chunk: ChunkPlan) -> int:
    """How many KV heads the chunk carries (num_heads 0: all its rank holds)."""
    return chunk.num_heads or src[chunk.src_rank][chunk.layer].shape[2]


def is_whole(src: list[list[torch.Tensor]], chunk: ChunkPlan) -> bool:
    """The chunk carries every head of its rank: whole slabs, no strided copy."""
    return chunk.src_head == 0 and chunk_heads(src, chunk) == src[chunk.src_rank][chunk.layer].shape[2]


def chunk_nbytes(src: list[list[torch.Tensor]], chunk: ChunkPlan) -> int:
    _, rows, _, head_bytes = src[chunk.src_rank][chunk.layer].shape
    return chunk.num_layers * chunk.num_blocks * rows * chunk_heads(src, chunk) * head_bytes


def gather(src: list[list[torch.Tensor]], chunk: ChunkPlan, block_ids: list[int], out=None) -> torch.Tensor:
    """The chunk's bytes as one contiguous ``[layers * n, bytes per block]`` tensor (a view when it can be).

    out: a flat uint8 buffer of the right size to copy into, instead of a fresh allocation.
    """
    return slabs.gather_heads(src[chunk.src_rank], chunk.layers, block_ids, chunk.src_head,
                              chunk_heads(src, chunk), out)


def pieces(src: list[list[torch.Tensor]], chunk: ChunkPlan, block_ids: list[int]) -> list:
    """The chunk's bytes as buffer views (CPU), layer-major, for a zero-copy join: the slabs themselves when it
    carries all of its rank's heads, else one strided copy."""
    if not is_whole(src, chunk):
        return [gather(src, chunk, block_ids).numpy()]
    layers = slabs.as_slabs(src[chunk.src_rank])
    runs = contiguous_runs(block_ids)
    return [layers[layer][b:b + n].numpy() for layer in chunk.layers for b, n in runs]


def crc32_of(t: torch.Tensor) -> int:
    return zlib.crc32(t.reshape(-1).cpu().numpy()) & 0xFFFFFFFF
