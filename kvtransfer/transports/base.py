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
        """Send the slabs of ``chunk`` (its layers x ``src_block_ids[chunk.first_block:+chunk.num_blocks]``).

        src: every layer as ``[num_blocks, slab_bytes]`` uint8 (``slabs.byte_views``).
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


def gather(src: list[torch.Tensor], chunk: ChunkPlan, block_ids: list[int], out=None) -> torch.Tensor:
    """The chunk's slabs as one contiguous ``[layers * n, slab_bytes]`` tensor (a view when it can be).

    out: a flat uint8 buffer of the right size to copy into, instead of a fresh allocation.
    """
    return slabs.gather(src, chunk.layers, block_ids, out)


def pieces(src: list[torch.Tensor], chunk: ChunkPlan, block_ids: list[int]) -> list:
    """The chunk's slabs as buffer views (CPU), layer-major, for a zero-copy join."""
    runs = contiguous_runs(block_ids)
    return [src[layer][b:b + n].numpy() for layer in chunk.layers for b, n in runs]


def crc32_of(t: torch.Tensor) -> int:
    return zlib.crc32(t.reshape(-1).cpu().numpy()) & 0xFFFFFFFF
