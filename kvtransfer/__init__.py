"""The KV transfer service: move a prompt's KV cache from a prefill worker into a decode worker's blocks.

``KVReceiver`` (decode side) reserves blocks and hands out Tickets;
``KVSender`` (prefill side) pushes layers into them. Transports, by name:
``grpc``, ``nccl`` (gloo on CPU tensors), ``local``.
"""
from engine.block_pool import NoFreeBlocksError
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from kvtransfer.types import HandshakeError, State, Ticket, TransferError, TransferResult

__all__ = ["KVReceiver", "KVSender", "Ticket", "TransferResult", "State", "HandshakeError", "TransferError",
           "NoFreeBlocksError"]
