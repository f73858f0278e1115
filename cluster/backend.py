"""What a frontend needs from the cluster: the `Backend` protocol.

The gRPC frontend (`cluster.grpc_frontend`) and the OpenAI HTTP frontend speak to
a `Backend`; the launcher provides the real one (router + stage replicas),
tests provide small fakes. Frontends validate and tokenize; the backend
places, runs, detokenizes and applies stop strings.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from cluster.types import ClusterStatus, GenerateDelta, GenerateRequest


@runtime_checkable
class Tokenizer(Protocol):
    """The two calls a frontend makes. A Hugging Face tokenizer fits as is.

    The HTTP frontend also calls ``decode([token_id])``, when the tokenizer
    has it, for the token text in OpenAI logprobs (``token_id:<id>`` otherwise).
    """

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the model's BOS if it uses one."""
        ...

    def apply_chat_template(self, conversation: list[dict[str, str]], *, add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: list[dict] | None = None) -> str:
        """Render ``[{"role": ..., "content": ...}, ...]`` as prompt text (called with tokenize=False).

        The frontend encodes the result with ``add_special_tokens=False``: the
        template already holds any BOS.
        """
        ...


@runtime_checkable
class Backend(Protocol):
    model_name: str  # the served model's id; requests may name it or leave the model empty
    tokenizer: Tokenizer
    max_model_len: int  # prompt + generated tokens must fit in this
    vocab_size: int  # token ids in prompts and stop_token_ids must be below this

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Run a validated request; an async generator of its deltas.

        Contract:
        - Raises `OverloadedError` (every replica busy, queue full or timed
          out) or `NoReplicaError` before the first delta; any other
          exception is a failure of the cluster.
        - The last delta, and only it, has ``finish_reason`` set; a request
          that fails after starting ends with ``FinishReason.ERROR`` and
          ``error`` set, or raises. The last delta may carry the stage-side
          timings as ``stage_metrics`` (`cluster.types.StageMetrics`) for
          the Prometheus metrics, and, when ``request.timeline`` is set, the
          request's phases as ``timeline`` (`cluster.types.RequestTimeline`).
        - If the consumer stops early (``aclose()``), the request is aborted
          and everything it held is freed.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds. A no-op for unknown or finished ids."""
        ...

    async def status(self) -> ClusterStatus:
        """Replicas, their load and KV usage, and the admission queue's length."""
        ...

    # Optional, not part of the protocol (the gRPC Profile RPC answers
    # UNIMPLEMENTED without it):
    #   async def profile(self, seconds: float, out_dir: str) -> list[ProfileTrace]
    # records a profiler window of ``seconds`` on every replica and returns the
    # Chrome traces they wrote, each on its replica's host.
