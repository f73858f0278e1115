"""The KV transfer service: move a prompt's KV cache from a prefill worker into a decode worker's blocks.

``KVReceiver`` (decode side) reserves blocks and hands out Tickets;
``KVSender`` (prefill side) pushes layers into them. Transports, by name:
``grpc``, ``nccl`` (gloo on CPU tensors), ``local``.

Heavy modules load on first use, so `import kvtransfer.planner` (plain
Python) stays torch-free.
"""

_EXPORTS = {
    "KVReceiver": "kvtransfer.receiver", "KVSender": "kvtransfer.sender", "Ticket": "kvtransfer.types",
    "TransferResult": "kvtransfer.types", "State": "kvtransfer.types", "HandshakeError": "kvtransfer.types",
    "TransferError": "kvtransfer.types", "NoFreeBlocksError": "engine.block_pool",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)


__all__ = list(_EXPORTS)
