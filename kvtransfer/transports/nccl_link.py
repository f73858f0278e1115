"""The `nccl` transport: bytes over a torch.distributed point-to-point pair, control over gRPC.

For each chunk the sender gathers the slabs into one contiguous buffer,
announces it over gRPC (transfer id, layer, block range, tag, size) and posts
an ``isend`` with a fresh tag on the pair's process group (see pairing.py).
The receiver's Announce handler posts the matching ``irecv`` into a staging
buffer and then hands it to ReceiverCore, which copies it into the ticket's
blocks only if the transfer still accepts data. Many chunks, of many
transfers, are in flight per pair; tags keep them apart.
"""
from __future__ import annotations

import datetime
import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtransfer.config import SenderConfig
from kvtransfer.planner import ChunkPlan
from kvtransfer.transports import pairing
from kvtransfer.transports.base import chunk_ids, chunk_nbytes, crc32_of, done, gather
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
        self._tags = itertools.count(1)
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
        staging = self.staging.take(chunk_nbytes(src, chunk))
        data = gather(src, chunk, ids, out=staging).contiguous()  # [layers * n, bytes per block]
        with self._tag_lock:
            tag = next(self._tags)
        header = pb.Chunk(transfer_id=transfer_id, layer=chunk.layer, first_block=chunk.first_block,
                          num_blocks=chunk.num_blocks, num_layers=chunk.num_layers, tag=tag,
                          head_start=chunk.head_start, num_heads=chunk.num_heads, nbytes=data.numel())
        if checksum:
            header.has_checksum, header.crc32 = True, crc32_of(data)
        if not self._window.acquire(timeout=self.chunk_timeout_s):
            return done(Ack(False, error="flow-control window stuck: receiver not acknowledging"))
        out: Future = Future()
        out.add_done_callback(lambda _: self._window.release())
        self._issuer.submit(self._issue, header, data, staging, out)
        return out

    def _issue(self, header, data: torch.Tensor, staging: torch.Tensor, out: Future) -> None:
        """Announce the chunk and post its send (gloo writes what the socket takes right here)."""
        announced = self._call(self.stub.Announce, header)
        try:
            work = self.pair.send(data.view(-1), header.tag, pairing.RECEIVER_RANK)
        except Exception as e:
            self.is_broken = True
            out.set_result(Ack(False, error=f"receiver lost: {e}"))
            return
        self._waiters.submit(self._wait, work, announced, data, staging).add_done_callback(
            lambda f: out.set_result(_ack_of(f)))

    def _wait(self, work, announced: Future, data: torch.Tensor, staging: torch.Tensor) -> Ack:
        try:
            work.wait(datetime.timedelta(seconds=self.chunk_timeout_s))
        except Exception as e:  # connection closed or timeout: the receiver is gone (staging not reused)
            self.is_broken = True
            return Ack(False, error=f"receiver lost: {str(e).splitlines()[0][:200]}")
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
