"""The decode side of a transfer: reserve blocks, accept chunks, report results.

1. ``reserve()`` (owner thread) allocates blocks from the engine's pool and
   returns a Ticket with a lease.
2. Transport threads call ``ReceiverCore.write_chunk/commit/abort``
   (receiver_core.py) as chunks and control messages arrive; they only ever
   write into the ticket's blocks, under the transfer's lock, while it still
   accepts data.
3. ``poll()`` (owner thread) expires leases, frees the blocks of FAILED
   transfers and returns every transfer that finished since the last poll.
4. ``release()`` hands a DONE transfer's blocks to the engine.

The BlockPool is touched only from the owner's thread: reserve, renew,
abort, poll, release and close must all be called from one thread (the
decode loop, which polls every step). A lease is enforced twice: transport
threads refuse data once its deadline has passed, and the next poll() frees
the blocks and reports FAILED.

Tensor parallelism: one receiver per decode replica, in rank 0's process,
writing every rank's cache (``kv_caches`` rank -> layer, with the replica's
KVLayout; engine.parallel maps the other ranks' caches from shared memory).
A ticket's blocks are the same block ids on every rank (one pool, rank 0's),
so a transfer is DONE, and its chunks and commit acknowledged, only when
every decode rank holds every one of its heads: the one ack covers them all.

One ``config.ReceiverConfig`` sets the transport, address, lease, timeouts
and handler threads; the transport's service gets it whole. This module
imports the transports; they import ``receiver_core``, never this module.
"""
from __future__ import annotations

import time
import uuid

from engine.block_pool import BlockPool, NoFreeBlocksError  # noqa: F401  (re-exported)
from kvtransfer.config import ReceiverConfig
from kvtransfer.layout import KVLayout
from kvtransfer.ledger import Inbound
from kvtransfer.planner import Coverage, blocks_for_tokens
from kvtransfer.receiver_core import ReceiverCore
from kvtransfer.types import Ticket, TransferResult


class KVReceiver:
    """Decode-side endpoint of the transfer service, configured by one ReceiverConfig (its service gets it
    whole). See the module docstring for threading.

    ``config.max_workers``: the service's handler threads (made as needed). A sending grpc link holds one per
    open Push stream (its ``num_channels`` while it sends, none after ``stream_idle_s`` idle), and
    every control call or nccl announce in flight holds one; calls beyond that wait for a thread.
    """

    def __init__(self, kv_caches, pool: BlockPool, fingerprint: dict[str, str], config: ReceiverConfig,
                 layout: KVLayout | None = None):
        """kv_caches: rank -> layer -> tensor (``layout`` says which heads each rank holds), or at TP=1
        layer -> tensor (layout None: read from the shapes). ``fingerprint`` gets the layout's fields."""
        self.pool = pool
        self.config = config
        self.transport = config.transport
        self.core = ReceiverCore(kv_caches, fingerprint, config.secret, config.progress_timeout_s, layout)
        self.layout = self.core.layout
        self.block_size = self.layout.block_size
        self.num_layers = self.layout.num_layers
        self._server = None
        if self.transport == "local":
            from kvtransfer.transports import local

            self.endpoint = local.register(self.core)
        else:
            from kvtransfer.transports import service

            self._server, self.endpoint = service.serve(self.core, config)

    # ---- owner thread ----------------------------------------------------
    def reserve(self, request_id: str, num_tokens: int, lease_s: float | None = None) -> Ticket:
        """Allocate the blocks for ``num_tokens`` and return their ticket (lease: ``config.lease_s`` unless
        given). Raises NoFreeBlocksError."""
        lease_s = self.config.lease_s if lease_s is None else lease_s
        if self.core.ledger.for_request(request_id) is not None:
            raise ValueError(f"request {request_id!r} already has a transfer")
        num_blocks = blocks_for_tokens(num_tokens, self.block_size)
        block_ids = self.pool.allocate(num_blocks)
        ticket = Ticket(uuid.uuid4().hex, request_id, self.endpoint, block_ids, time.time() + lease_s,
                        self.transport)
        self.core.ledger.add(Inbound(ticket, num_tokens, Coverage(self.num_layers, num_blocks,
                                                                  self.layout.num_kv_heads), ticket.lease_deadline))
        return ticket

    def renew(self, request_id: str, lease_s: float) -> None:
        inbound = self.core.ledger.for_request(request_id)
        if inbound is None:
            raise KeyError(f"no transfer for request {request_id!r}")
        self.core.renew(inbound.ticket.transfer_id, lease_s)

    def abort(self, request_id: str, reason: str = "aborted by receiver") -> None:
        """Fail the transfer and free its blocks now; poll() reports it FAILED with ``reason``. No-op when
        unknown, or when it is DONE already (every layer and the commit landed: poll() reports it DONE)."""
        inbound = self.core.ledger.for_request(request_id)
        if inbound is None:
            return
        with inbound.lock:
            inbound.fail(reason)
            self._free_if_failed(inbound)

    def poll(self) -> list[TransferResult]:
        """Never blocks (beyond a chunk copy in progress): expires leases, frees FAILED blocks."""
        results = []
        now = time.time()
        for inbound in self.core.ledger.all():
            with inbound.lock:
                inbound.accepts(now)  # expires an overdue lease
                if not inbound.state.is_finished or inbound.is_reported:
                    continue
                self._free_if_failed(inbound)
                inbound.is_reported = True
                results.append(inbound.result())
            if inbound.is_freed:
                self.core.ledger.remove(inbound)
        return results

    def release(self, request_id: str) -> list[int]:
        """Hand a DONE transfer's blocks to the engine (which frees them when the sequence ends)."""
        inbound = self.core.ledger.for_request(request_id)
        if inbound is None or inbound.state.name != "DONE":
            raise KeyError(f"no DONE transfer for request {request_id!r}")
        with inbound.lock:
            inbound.is_freed = True
        self.core.ledger.remove(inbound)
        return list(inbound.ticket.block_ids)

    def close(self) -> None:
        """Stop serving; fail every open transfer and free its blocks. DONE, unreleased blocks are freed too."""
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None
        if self.transport == "local":
            from kvtransfer.transports import local

            local.unregister(self.endpoint)
        for inbound in self.core.ledger.all():
            with inbound.lock:
                inbound.fail("receiver closed")
                if not inbound.is_freed:
                    self.pool.free(inbound.ticket.block_ids)
                    inbound.is_freed = True
            self.core.ledger.remove(inbound)
        self.core.close_sessions()

    def _free_if_failed(self, inbound: Inbound) -> None:  # inbound.lock held
        if inbound.state.name == "FAILED" and not inbound.is_freed:
            self.pool.free(inbound.ticket.block_ids)
            inbound.is_freed = True
