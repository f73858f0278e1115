"""The `nccl` transport: bytes over a torch.distributed point-to-point pair, control over gRPC.

For each chunk the sender announces it over gRPC (transfer id, layers, block
range, heads, first tag, size) and posts one ``isend`` per layer, with the
tags ``tag .. tag + num_layers - 1``, on the pair's process group (see
pairing.py; a chunk whose layers are smaller than ``pairing.MIN_PART_BYTES``
goes as one message). A layer's part is sent straight from the cache where it is one
contiguous run of whole slabs on the pair's device (a view: no copy); any
other chunk (a head range of a rank's slabs, scattered blocks, a cache on
another GPU) is gathered into a staging buffer first and sent as its layers'
slices. The receiver's Announce handler posts the matching ``irecv``s into
the slices of one staging buffer and then hands it to ReceiverCore, which
copies it into the ticket's blocks only if the transfer still accepts data.
Many chunks, of many transfers, are in flight per pair; tags keep them apart.

Per-layer messages under one announce: a chunk of several layers (two ranks'
half-size units, coalesced) would otherwise be copied into one buffer only to
be sent as one message, where the homogeneous chunk of one layer is sent
from the cache as it lies (BENCHMARKS.md, "Heterogeneous TP KV transfer").
"""
from __future__ import annotations

import datetime
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtransfer.config import SenderConfig
from kvtransfer.planner import ChunkPlan
from kvtransfer.transports import pairing
from kvtransfer import slabs
from kvtransfer.planner import contiguous_runs
from kvtransfer.transports.base import chunk_ids, chunk_nbytes, done, gather, is_whole
from kvtransfer.transports.grpc_link import GrpcControl
from kvtransfer.types import Ack, TransferError
from protos import kvtransfer_pb2 as pb


def pair_device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class NcclLink(GrpcControl):
    transport = "nccl"

    def __init__(self, endpoint: str, channel, session_id: str, config: SenderConfig, pair: pairing.PairGroup):
        super().__init__(endpoint, channel, session_id, config)
        self.pair = pair
        self._next_tag = 1
        self._tag_lock = threading.Lock()
        self._window = threading.Semaphore(config.nccl.window)
        # Starting a send writes what the socket takes in the caller's thread; a thread of its own
        # lets the sender's worker gather the next chunk meanwhile.
        self._issuer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvt-p2p-send")
        self._waiters = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvt-p2p")
        self.staging = pairing.StagingBuffers(pair_device(pair.backend))

    @classmethod
    def connect(cls, endpoint: str, fingerprint: dict[str, str], config: SenderConfig) -> "NcclLink":
        channel, reply = cls._handshake(endpoint, fingerprint, config)
        pair = pairing.PairGroup(reply.backend)
        try:
            store = pairing.join_store(reply.store_host, reply.store_port, config.connect_timeout_s)
            pair.group = pairing.make_group(store, reply.pair_id, pairing.SENDER_RANK, reply.backend,
                                            reply.store_host, config.chunk_timeout_s)
            pair._ready.set()
        except Exception as e:
            channel.close()
            raise TransferError(f"cannot join the process group of {endpoint}: {e}") from None
        link = cls(endpoint, channel, reply.session_id, config, pair)
        link._set_peer(reply)
        return link

    def send_chunk(self, transfer_id, chunk: ChunkPlan, src: torch.Tensor, src_block_ids, checksum):
        ids = chunk_ids(chunk, src_block_ids)
        parts, staging = self._parts(src, chunk, ids)  # per layer: [bytes] (a view of the cache, or of staging)
        with self._tag_lock:
            tag = self._next_tag
            self._next_tag += len(parts)
        header = pb.Chunk(transfer_id=transfer_id, layer=chunk.layer, first_block=chunk.first_block,
                          num_blocks=chunk.num_blocks, num_layers=chunk.num_layers, tag=tag,
                          head_start=chunk.head_start, num_heads=chunk.num_heads,
                          nbytes=sum(p.numel() for p in parts))
        if checksum:
            header.has_checksum, header.crc32 = True, _crc32(parts)
        if not self._window.acquire(timeout=self.chunk_timeout_s):
            if staging is not None:
                self.staging.give(staging)
            return done(Ack(False, error="flow-control window stuck: receiver not acknowledging"))
        out: Future = Future()
        out.add_done_callback(lambda _: self._window.release())
        self._issuer.submit(self._issue, header, parts, staging, out)
        return out

    def _parts(self, src, chunk: ChunkPlan, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The chunk's bytes, one flat tensor per layer, and the staging buffer they live in (None: they
        are views of the cache, sent as they lie)."""
        layers = src[chunk.src_rank]
        runs = contiguous_runs(ids)
        nbytes = chunk_nbytes(src, chunk)
        num_parts = pairing.num_parts(nbytes, chunk.num_layers)
        if (num_parts == chunk.num_layers and is_whole(src, chunk) and len(runs) == 1
                and layers[chunk.layer].device == self.staging.device):  # (a pipeline rank: None where it holds no layer)
            first, n = runs[0]
            whole = slabs.as_slabs(layers)
            return [whole[layer][first:first + n].reshape(-1) for layer in chunk.layers], None
        staging = self.staging.take(nbytes)
        data = gather(src, chunk, ids, out=staging)  # [layers * n, bytes per block], into staging
        return list(data.reshape(num_parts, -1)), staging

    def _issue(self, header, parts: list[torch.Tensor], staging, out: Future) -> None:
        """Announce the chunk and post its sends, one a layer (gloo writes what the socket takes right here)."""
        announced = self._call(self.stub.Announce, header)
        try:
            works = [self.pair.send(p, header.tag + i, pairing.RECEIVER_RANK) for i, p in enumerate(parts)]
        except Exception as e:
            self.is_broken = True
            out.set_result(Ack(False, error=f"receiver lost: {e}"))
            return
        self._waiters.submit(self._wait, works, announced, parts, staging).add_done_callback(
            lambda f: out.set_result(_ack_of(f)))

    def _wait(self, works: list, announced: Future, parts: list[torch.Tensor], staging) -> Ack:
        try:
            for work in works:
                work.wait(datetime.timedelta(seconds=self.chunk_timeout_s))
        except Exception as e:  # connection closed or timeout: the receiver is gone (staging not reused)
            self.is_broken = True
            return Ack(False, error=f"receiver lost: {str(e).splitlines()[0][:200]}")
        if staging is not None:
            self.staging.give(staging)
        return announced.result(timeout=self.chunk_timeout_s)

    def close(self) -> None:
        self._issuer.shutdown(wait=False, cancel_futures=True)
        self._waiters.shutdown(wait=False, cancel_futures=True)
        super().close()


def _ack_of(future: Future) -> Ack:
    if future.cancelled():
        return Ack(False, error="link closed")
    if future.exception() is not None:
        return Ack(False, error=f"{type(future.exception()).__name__}: {future.exception()}")
    return future.result()


def _crc32(parts: list[torch.Tensor]) -> int:
    """The CRC-32 of the parts' bytes in order, as the receiver computes it over its one buffer."""
    crc = 0
    for p in parts:
        crc = zlib.crc32(p.reshape(-1).cpu().numpy(), crc)
    return crc & 0xFFFFFFFF
