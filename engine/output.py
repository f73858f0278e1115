"""From step outputs (token ids) to what users see: text deltas with stop
strings applied, finish reasons, logprobs and timings.

`OutputProcessor` turns each step's tokens into the one delta type,
`engine.serving.types.GenerateDelta`, which a served replica sends to the
frontend as is; the offline `LLM` folds the deltas into `RequestOutput`s.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence, SequenceStatus
from engine.serving.types import FinishReason, GenerateDelta, TokenLogprob


@dataclass
class RequestOutput:
    """The offline API's view of a request so far (`engine.LLM`)."""

    request_id: str
    prompt_token_ids: list[int]
    text: str  # full text so far
    token_ids: list[int]  # all output token ids so far
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token that ended it
    error: str | None = None
    logprobs: list[dict] | None = None  # one per token in token_ids (when asked for)
    delta_logprobs: list[dict] | None = None  # one per token in delta_token_ids
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # params.prompt_logprobs set: one per prompt token, None for the first (nothing precedes it), the
    # others as `logprobs`' with the token's "rank" (1: the model's likeliest)
    prompt_logprobs: list[dict | None] | None = None


class OutputProcessor:
    """Detokenizes incrementally and applies stop strings for each request."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._detok: dict[str, object] = {}

    def add(self, seq: Sequence, emitted_token_ids: list[int] = ()) -> str:
        """Start detokenizing ``seq``'s output. ``emitted_token_ids``: output
        tokens the client already has from elsewhere (a prefilled sequence's
        first token; a resumed request's tokens so far). The detokenizer reads
        them one at a time, as every replica steps it, so it holds back the
        same text the replica that sent them did; returns the text the last
        of them added."""
        from engine.tokenizer import IncrementalDetokenizer

        if self.tokenizer is None:
            return ""
        p = seq.params
        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
                                       stop=p.stop, include_stop=p.include_stop_str_in_output, min_tokens=p.min_tokens)
        self._detok[seq.request_id] = detok
        text = ""
        for t in emitted_token_ids:
            text = detok.step([t])
        return text

    def is_stopped(self, request_id: str) -> bool:
        """Whether a stop string has ended the request's text."""
        detok = self._detok.get(request_id)
        return bool(detok is not None and detok.stopped)

    def discard(self, request_id: str) -> None:
        self._detok.pop(request_id, None)

    def process(self, seq: Sequence, new_token_ids: list[int]) -> tuple[GenerateDelta, bool]:
        """The delta for ``new_token_ids``, just appended to ``seq``, and
        whether a stop string ended the request (the caller must then finish
        the sequence in its engine and stamp ``timings``)."""
        detok = self._detok.get(seq.request_id)
        text = detok.step(new_token_ids) if detok is not None and new_token_ids else ""
        # A stop string may complete on the same token that ends the sequence
        # (max_tokens, eos): the text is cut there all the same, so it is a stop.
        hit_stop_string = bool(detok is not None and detok.stopped)
        stopped_by_string = hit_stop_string and not seq.is_finished
        finished = seq.is_finished or stopped_by_string
        if finished and detok is not None and not detok.stopped:
            text += detok.flush()  # text held back as a possible stop-string start
        delta = GenerateDelta(seq.request_id, list(new_token_ids), text,
                              logprobs=_logprobs(seq, new_token_ids), num_cached_tokens=seq.num_prefix_hit_tokens,
                              prompt_logprobs=prompt_logprobs(seq, new_token_ids))
        if finished:
            delta.finish_reason = FinishReason.STOP if hit_stop_string else FinishReason(seq.finish_reason)
            delta.error = seq.error
            if hit_stop_string:
                delta.stop_reason = detok.stop_string
            elif seq.status == SequenceStatus.FINISHED_STOPPED and seq.output_token_ids:
                delta.stop_reason = seq.output_token_ids[-1]
            delta.timings = seq.metrics.timings()
            self._detok.pop(seq.request_id, None)
        return delta, stopped_by_string


def prompt_logprobs(seq: Sequence, new_token_ids: list[int]) -> list[TokenLogprob] | None:
    """The prompt's logprobs, for the delta of ``seq``'s first output tokens (``new_token_ids``) when it
    asked for them; None otherwise (later deltas, and a resumed sequence's, whose client has them)."""
    if seq.params.prompt_logprobs is None or not new_token_ids or seq.num_output_tokens != len(new_token_ids):
        return None
    return [TokenLogprob.from_sampler(t, info) for t, info in zip(seq.prompt_token_ids[1:], seq.prompt_logprobs)]


def _logprobs(seq: Sequence, new_token_ids: list[int]) -> list[TokenLogprob] | None:
    if not seq.output_logprobs or not new_token_ids:
        return None
    infos = seq.output_logprobs[-len(new_token_ids):]
    return [TokenLogprob.from_sampler(t, info) for t, info in zip(new_token_ids, infos)]
