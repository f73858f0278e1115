"""Movers: each transport is its own module, imported lazily by name.

A receiver-side transport serves ``ReceiverCore`` (``service.py`` for grpc
and nccl, ``local.py`` for the same process); a sender-side ``Link`` (see
``base.py``) is one authenticated connection to one receiver endpoint.
Transports import ``receiver_core`` and ``types``, never the endpoints
(``receiver.py``, ``sender.py``) that use them. Each gets its config whole:
a link the sender's ``SenderConfig``, the service the receiver's
``ReceiverConfig``; there are no loose keyword options to drop.
"""
from __future__ import annotations

from kvtransfer.config import SenderConfig


def connect(endpoint: str, fingerprint: dict[str, str], config: SenderConfig):
    """Open and authenticate a Link to ``endpoint`` ("grpc://h:p", "nccl://h:p", "local://id").

    Blocks up to ``config.connect_timeout_s``; raises HandshakeError or TransferError.
    """
    scheme = endpoint.split("://", 1)[0]
    if scheme == "local":
        from kvtransfer.transports.local import LocalLink as cls
    elif scheme == "grpc":
        from kvtransfer.transports.grpc_link import GrpcLink as cls
    elif scheme == "nccl":
        from kvtransfer.transports.nccl_link import NcclLink as cls
    else:
        raise ValueError(f"unknown transport in endpoint {endpoint!r}")
    return cls.connect(endpoint, fingerprint, config)
