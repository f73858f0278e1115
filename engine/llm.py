"""`LLM`: the offline, single-process API. Continuous batching, chunked
prefill, prefix caching and preemption come from EngineCore; this adds
tokenization, detokenization and stop strings.

    llm = LLM()                                    # the default model
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(out[0].text)
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.output import OutputProcessor, RequestOutput
from engine.sampling import SamplingParams, bad_words_token_ids
from engine.sequence import Sequence, SequenceStatus

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        device: str = "cpu",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float = 1.0,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        pipeline_layer_split: list[int] | tuple[int, ...] | None = None,
        tp_backend: str = "auto",
        tp_timeout_s: float = 60.0,
        kernel_isa: str = "auto",
        quantization: str = "none",
        enable_expert_parallel: bool = False,
        expert_placement: str = "contiguous",
        moe_dispatch: str = "allreduce",
        cache_dir: str | Path | None = None,
    ):
        from engine.tokenizer import Tokenizer, TokenizerError
        from engine.weights import load_checkpoint, resolve_model

        config = EngineConfig(
            dtype=dtype, device=device, block_size=block_size, num_kv_blocks=num_kv_blocks,
            kv_cache_memory_gb=kv_cache_memory_gb, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, seed=seed, enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            pipeline_layer_split=tuple(pipeline_layer_split) if isinstance(pipeline_layer_split, list)
            else pipeline_layer_split,
            tp_backend=tp_backend, tp_timeout_s=tp_timeout_s,
            kernel_isa=kernel_isa, quantization=quantization, enable_expert_parallel=enable_expert_parallel,
            expert_placement=expert_placement, moe_dispatch=moe_dispatch)
        config.validate()
        self.model_dir = resolve_model(None if model is None else str(model), cache_dir=cache_dir)
        try:
            self.tokenizer = Tokenizer.from_folder(self.model_dir)
        except TokenizerError:
            self.tokenizer = None  # a bare checkpoint: prompts must be token ids, outputs have no text
        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            from engine.parallel import start_engine

            self.core = start_engine(self.model_dir, config)  # ranks 1..N-1 in processes of their own
        else:
            model_config, weights = load_checkpoint(self.model_dir, torch.float32, quantization=config.quantization)
            self.core = EngineCore(model_config, weights, config)
            del weights
        if self.tokenizer is not None:
            self.core.eos_token_ids |= frozenset(self.tokenizer.eos_token_ids)
            self.core.enable_guided(self.tokenizer.hf)
        self.outputs = OutputProcessor(self.tokenizer)
        self._texts: dict[str, str] = {}  # request id -> its text so far
        self._ids = itertools.count()

    @property
    def model_config(self):
        return self.core.model_config

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (garbage collection and
        interpreter exit do it too). Idempotent."""
        self.core.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- request intake -------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            if self.tokenizer is None:
                raise ValueError(f"prompt: {self.model_dir} has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise TypeError("prompt: must be a string or a list of token ids")
        return list(prompt)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """With ``params.n`` > 1, the choices run as ``request_id``, ``request_id#1``, ... (`choice_ids`): one
        prompt, computed once, its full blocks shared by the n sequences."""
        params = params or SamplingParams()
        params.validate()
        if params.bad_words and not params.bad_words_token_ids:
            if self.tokenizer is None:
                raise ValueError(f"bad_words: {self.model_dir} has no tokenizer; pass bad_words_token_ids")
            params = dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(
                lambda text: self.tokenizer.encode(text, add_special_tokens=False), params.bad_words))
        request_id = request_id or f"req-{next(self._ids)}"
        token_ids = self.encode(prompt)
        first = None
        for j, rid in enumerate(self.choice_ids(request_id, params.n)):
            seq = Sequence(rid, list(token_ids), params if params.n == 1 else params.for_choice(j), fork_of=first)
            self.core.add(seq)
            self.outputs.add(seq)
            self._texts[rid] = ""
            first = first or seq
        return request_id

    @staticmethod
    def choice_ids(request_id: str, n: int) -> list[str]:
        """The request ids of a request's n choices, in choice order."""
        return [request_id] + [f"{request_id}#{j}" for j in range(1, n)]

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self.outputs.discard(request_id)
        self._texts.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # ---- the loop -------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of requests that produced a token."""
        results = []
        for out in self.core.step():
            seq = out.seq
            delta, stopped = self.outputs.process(seq, out.new_token_ids)
            if stopped:
                self.core.finish(seq, SequenceStatus.FINISHED_STOPPED)
            text = self._texts[seq.request_id] + delta.text
            if delta.is_finished:
                del self._texts[seq.request_id]
            else:
                self._texts[seq.request_id] = text
            lps = seq.output_logprobs
            results.append(RequestOutput(
                seq.request_id, seq.prompt_token_ids, text, list(seq.output_token_ids), delta.text,
                delta.token_ids, delta.is_finished,
                delta.finish_reason.value if delta.finish_reason is not None else None, delta.stop_reason,
                delta.error, list(lps) if lps else None,
                lps[-len(delta.token_ids):] if lps and delta.token_ids else None, delta.num_cached_tokens,
                seq.metrics.as_dict() if delta.is_finished else {}, _prompt_logprobs(seq)))
        return results

    def generate(self, prompts: Prompt | Iterable[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order (a prompt's n choices in a row)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: got {len(plist)} for {len(prompts)} prompts")
        ids = []
        try:
            for p, sp in zip(prompts, plist):
                ids.extend(self.choice_ids(self.add_request(p, sp), (sp or SamplingParams()).n))
            final: dict[str, RequestOutput] = {}
            while len(final) < len(ids):
                for ro in self.step():
                    if ro.finished:
                        final[ro.request_id] = ro
            return [final[i] for i in ids]
        finally:
            for i in ids:
                if self.core.get(i) is not None:
                    self.abort(i)

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError(f"messages: {self.model_dir} has no tokenizer or chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        # the template already holds any BOS, so encode without special tokens
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(m), add_special_tokens=False)
                   for m in convs]
        return self.generate(prompts, params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one output per new token for a single request (alongside any
        other requests already in the engine)."""
        if params is not None and params.n > 1:
            raise ValueError("n: stream follows one choice; use generate for n > 1")
        rid = self.add_request(prompt, params)
        try:
            while True:
                for ro in self.step():
                    if ro.request_id == rid:
                        yield ro
                        if ro.finished:
                            return
        finally:
            if self.core.get(rid) is not None:
                self.abort(rid)


def _prompt_logprobs(seq: Sequence) -> list[dict | None] | None:
    """`RequestOutput.prompt_logprobs`: choice 0 computes them for a request's every choice (n > 1)."""
    owner = seq.fork_of or seq
    if owner.params.prompt_logprobs is None:
        return None
    return [None, *owner.prompt_logprobs]
