"""The KV transfer service: move a prompt's KV cache from a prefill worker into a decode worker's blocks.

``KVReceiver`` (decode side) reserves blocks and hands out Tickets;
``KVSender`` (prefill side) pushes layers into them. Transports, by name:
``grpc``, ``nccl`` (gloo on CPU tensors), ``local``.

Tensor parallelism (prefill at TP=a, decode at TP=b, any a, b the model's
KV heads allow): a replica has ONE endpoint, in rank 0's process, which
reads (prefill) or writes (decode) the cache of every rank; the worker
ranks' caches live in shared memory that rank 0 maps
(``engine.parallel.TPGroup.rank_kv_caches``). The seam a stage calls::

    from engine.kv_cache import model_fingerprint
    from kvtransfer.layout import engine_kv

    layout, caches = engine_kv(core)   # KVLayout; rank -> layer -> tensor ([core.kv_caches] at TP=1)
    fingerprint = model_fingerprint(core.model_config, core.kv_spec)
    sender = KVSender(fingerprint, sender_config, layout=layout)                     # prefill
    sender.start(ticket, caches, seq.block_ids[:len(ticket.block_ids)], num_tokens)  # block ids: rank 0's pool,
                                                                                     # the same on every rank
    receiver = KVReceiver(caches, core.pool, fingerprint, receiver_config, layout=layout)  # decode

The layer hook (``sender.hook``) and ``commit`` are called as at TP=1; at
TP>1 the sender holds a layer back until every rank has written it (see
``KVSender.push_layer``). The fingerprint carries the layout; the handshake
compares every other field as before and checks the reshard plan
(reshard.py) on both sides before a byte moves. A plain per-layer list and
no layout is the TP=1 case, the same code path with one rank.

Heavy modules load on first use, so `import kvtransfer.planner` and
`kvtransfer.reshard` (plain Python) stay torch-free.
"""

_EXPORTS = {
    "KVReceiver": "kvtransfer.receiver", "KVSender": "kvtransfer.sender", "Ticket": "kvtransfer.types",
    "TransferResult": "kvtransfer.types", "State": "kvtransfer.types", "HandshakeError": "kvtransfer.types",
    "TransferError": "kvtransfer.types", "PlanError": "kvtransfer.types", "KVLayout": "kvtransfer.layout",
    "NoFreeBlocksError": "engine.block_pool",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)


__all__ = list(_EXPORTS)
