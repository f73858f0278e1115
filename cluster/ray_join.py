"""Joining Ray: `init_ray`, whose failure says what to check, the auth token first.

A Ray head (2.52 on) may require token authentication. A process without
the token gets only "Failed to connect to Ray cluster" after a ~20 s
timeout, which reads like a wrong address; the error here names the
settings: ``RAY_AUTH_MODE=token`` with ``RAY_AUTH_TOKEN`` (or
``RAY_AUTH_TOKEN_PATH``, default ``~/.ray/auth_token``).
"""
from __future__ import annotations

import os

TOKEN_HINT = ("if the Ray head requires token authentication, give this process the cluster's token: "
              "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<token>, or RAY_AUTH_TOKEN_PATH=<file> "
              "(default ~/.ray/auth_token)")


class RayJoinError(ConnectionError):
    """kvrelay could not start or join Ray; the message says what to check."""


def join_failure(address: str | None, error: BaseException) -> RayJoinError:
    where = address or os.environ.get("RAY_ADDRESS") or "the local Ray instance"
    tokens = [name for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH") if os.environ.get(name)]
    have = f" ({', '.join(tokens)} is set: check that it holds this cluster's token)" if tokens else ""
    return RayJoinError(f"cannot connect to Ray at {where}: {error}. Check the address (spec ray.address or "
                        f"RAY_ADDRESS) and that the head is up; {TOKEN_HINT}{have}")


def init_ray(address: str | None, namespace: str) -> None:
    """``ray.init`` for the launcher; a failure to connect raises `RayJoinError` naming the token setting."""
    import ray

    try:
        ray.init(address=address, namespace=namespace, log_to_driver=True)
    except ConnectionError as e:
        raise join_failure(address, e) from e
    except RuntimeError as e:  # Ray's own authentication errors
        if "auth" not in str(e).lower() and "token" not in str(e).lower():
            raise
        raise join_failure(address, e) from e
