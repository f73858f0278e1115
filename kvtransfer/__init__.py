"""The KV transfer service: move a prompt's KV cache from a prefill worker into a decode worker's blocks.

``KVReceiver`` (decode side) reserves blocks and hands out Tickets;
``KVSender`` (prefill side) pushes layers into them. Transports, by name:
``grpc``, ``nccl`` (gloo on CPU tensors), ``local``.

``KVReceiver`` and ``KVSender`` are imported on first use, so that importing
a submodule (a transport, the configs) does not import the endpoints that
sit above it.
"""
from __future__ import annotations

import importlib

from engine.block_pool import NoFreeBlocksError
from kvtransfer.types import HandshakeError, State, Ticket, TransferError, TransferResult

_ENDPOINTS = {"KVReceiver": "kvtransfer.receiver", "KVSender": "kvtransfer.sender"}

__all__ = ["KVReceiver", "KVSender", "Ticket", "TransferResult", "State", "HandshakeError", "TransferError",
           "NoFreeBlocksError"]


def __getattr__(name: str):
    if name in _ENDPOINTS:
        return getattr(importlib.import_module(_ENDPOINTS[name]), name)
    raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
