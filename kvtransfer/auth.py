"""The handshake's two checks: the cluster secret and the model fingerprint.

Challenge-response, both ways: the receiver sends a nonce, the sender answers
with HMAC(secret, "kvt-sender" || nonce || sender_nonce) and its own nonce,
the receiver answers with HMAC(secret, "kvt-receiver" || sender_nonce). The
secret itself never crosses the wire.
"""
from __future__ import annotations

import hashlib
import hmac
import os


def as_secret(secret: bytes | str | None) -> bytes:
    if not secret:
        raise ValueError("a cluster secret is required: no secret, no transfer")
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def new_nonce() -> bytes:
    return os.urandom(16)


def sender_proof(secret: bytes, nonce: bytes, sender_nonce: bytes) -> bytes:
    return hmac.new(secret, b"kvt-sender" + nonce + sender_nonce, hashlib.sha256).digest()


def receiver_proof(secret: bytes, sender_nonce: bytes) -> bytes:
    return hmac.new(secret, b"kvt-receiver" + sender_nonce, hashlib.sha256).digest()


def proofs_match(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


# Carried in a fingerprint for whoever reads it, never compared: `weights`, the stage's weight
# format (EngineConfig.quantization). Replicas with different weight formats may share a
# deployment when the KV dtype and layout agree (BENCHMARKS.md "Quantized weights").
INFORMATIONAL_FIELDS = ("weights",)


def fingerprint_mismatch(ours: dict[str, str], theirs: dict[str, str], ignore=()) -> str | None:
    """None when equal but for the fields in `ignore` and INFORMATIONAL_FIELDS, else a message
    naming the first differing field."""
    for key in sorted((set(ours) | set(theirs)) - set(ignore) - set(INFORMATIONAL_FIELDS)):
        if ours.get(key) != theirs.get(key):
            return (f"model fingerprint mismatch on {key!r}: receiver has {ours.get(key)!r}, "
                    f"sender has {theirs.get(key)!r}")
    return None
