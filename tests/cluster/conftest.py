"""Scaffolding for the frontend and client tests: a tiny real tokenizer, an
echo backend and a gRPC frontend served from a background event loop.

`EchoBackend` is not the engine: it echoes the prompt's tokens back one per
delta, so that the frontend's own behaviour (streaming, validation, auth,
cancellation, error codes) can be tested before the engine lands.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from tokenizers.processors import TemplateProcessing

from cluster.grpc_frontend import GrpcFrontend
from cluster.configs import FrontendConfig
from cluster.types import (ClusterStatus, FinishReason, GenerateDelta, GenerateRequest, NoReplicaError,
                           OverloadedError, ProfileTrace, ReplicaStatus, RequestTimeline, Stage, StageMetrics,
                           TokenLogprob)

WORDS = "<unk> <s> </s> <|system|> <|user|> <|assistant|> hello world the cat sat on a mat".split()


class TinyTokenizer:
    """A WordLevel tokenizer over WORDS; BOS is <s>. Chat: '<|role|> content ... <|assistant|>'."""

    def __init__(self):
        tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
        tok.pre_tokenizer = WhitespaceSplit()
        tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        self._tok = tok
        self.vocab_size = len(WORDS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, conversation, *, add_generation_prompt=True, tokenize=False) -> str:
        text = "<s> " + " ".join(f"<|{m['role']}|> {m['content']}" for m in conversation)
        return text + (" <|assistant|>" if add_generation_prompt else "")


class EchoBackend:
    """Echoes the prompt's tokens one per delta: STOP at the prompt's end, LENGTH at max_tokens."""

    model_name = "echo"
    max_model_len = 64

    def __init__(self):
        self.tokenizer = TinyTokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self.reset()

    def reset(self):
        self.delay_s = 0.0
        self.overloaded = False
        self.no_replica = False  # every replica dead: generate raises NoReplicaError, status shows none alive
        self.fail_after: int | None = None  # raise after this many deltas
        self.error_after: int | None = None  # end with a FinishReason.ERROR delta after this many deltas
        self.raise_first: BaseException | None = None  # generate raises this before the first delta
        self.status_error: BaseException | None = None  # status() raises this
        self.requests: list[GenerateRequest] = []
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.profiles: list[tuple[float, str]] = []
        # requests served at once, as a router's capacity: a request holds its place until its stream is
        # read to the end (as cluster.ray_backend's placement), and one that finds none within 3 s is refused
        self.capacity: int | None = None
        self._places: asyncio.Semaphore | None = None

    async def generate(self, req: GenerateRequest):
        if self.overloaded:
            raise OverloadedError("all replicas are busy (test)")
        if self.no_replica:
            raise NoReplicaError("no live colocated replica (test)")
        if self.raise_first is not None:
            raise self.raise_first
        places = None
        if self.capacity is not None:
            places = self._places = self._places or asyncio.Semaphore(self.capacity)
            try:
                await asyncio.wait_for(places.acquire(), 3.0)
            except asyncio.TimeoutError:
                raise OverloadedError("no replica became free within 3 s (test)") from None
        self.requests.append(req)
        self.running.add(req.request_id)
        try:
            n = req.sampling.max_tokens
            out = (req.prompt_token_ids * n)[:n] if req.sampling.ignore_eos else req.prompt_token_ids[:n]
            for i, tok in enumerate(out):
                if self.fail_after == i:
                    raise RuntimeError("replica d0 died (test)")
                if self.error_after == i:
                    yield GenerateDelta(req.request_id, finish_reason=FinishReason.ERROR,
                                        error="decode replica d0 died mid-stream (test)")
                    return
                await asyncio.sleep(self.delay_s)
                last = i == len(out) - 1
                finish = None
                if last:
                    finish = FinishReason.LENGTH if len(out) == n else FinishReason.STOP
                logprobs = None
                if req.sampling.logprobs is not None:
                    logprobs = [TokenLogprob(tok, -0.5, tuple((t, -1.0 - t) for t in range(req.sampling.logprobs)))]
                stage_metrics = StageMetrics(0.001, 0.002, 0.003, 4096) if last else None
                timeline = None
                if last and req.timeline:
                    timeline = RequestTimeline(routed_s=0.001, prefill_end_s=0.01, finish_s=0.02)
                yield GenerateDelta(req.request_id, [tok], self.tokenizer.decode([tok]) + " ", finish, logprobs,
                                    num_cached_tokens=2 if last else 0, stage_metrics=stage_metrics,
                                    timeline=timeline)
        finally:
            self.running.discard(req.request_id)
            if places is not None:
                places.release()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def profile(self, seconds: float, out_dir: str) -> list[ProfileTrace]:
        self.profiles.append((seconds, out_dir))
        return [ProfileTrace("c0", "host-a", f"{out_dir}/c0-1.json")]

    async def status(self) -> ClusterStatus:
        if self.status_error is not None:
            raise self.status_error
        return ClusterStatus("echo", "colocated", (
            ReplicaStatus("c0", Stage.COLOCATED, not self.no_replica, len(self.running), 0, len(self.running), 75,
                          100),
            ReplicaStatus("c1", Stage.COLOCATED, False, 7, 300, 5, 10, 100),  # dead: its last report, now stale
        ), num_waiting=0)


class ServedFrontend:
    """A GrpcFrontend on 127.0.0.1 (any free port) in a background event loop."""

    def __init__(self, backend, **config):
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.frontend = GrpcFrontend(backend, FrontendConfig(host="127.0.0.1", grpc_port=0, **config))
        self.port = self.call(self.frontend.start())
        self.target = f"127.0.0.1:{self.port}"

    def call(self, coro, timeout=10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.call(self.frontend.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def echo_server():
    server = ServedFrontend(EchoBackend())
    yield server
    server.close()


@pytest.fixture
def served(echo_server):
    echo_server.backend.reset()
    yield echo_server
    assert not echo_server.backend.running, "a request was left running in the backend"


@pytest.fixture
def tls_cert(tmp_path):
    """A self-signed certificate for 127.0.0.1 / localhost: (cert path, key path)."""
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {made.stderr.decode()[-200:]}")
    return cert, key
