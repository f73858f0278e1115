"""From step outputs (token ids) to what users see: text deltas with stop
strings applied, finish reasons, logprobs and timings."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence, SequenceStatus


@dataclass
class RequestOutput:
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


class OutputProcessor:
    """Detokenizes incrementally and applies stop strings for each request."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._detok: dict[str, object] = {}

    def add(self, seq: Sequence) -> None:
        from engine.tokenizer import IncrementalDetokenizer

        if self.tokenizer is None:
            return

        self._detok[seq.request_id] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids,
            skip_special_tokens=seq.params.skip_special_tokens, stop=seq.params.stop)

    def discard(self, request_id: str) -> None:
        self._detok.pop(request_id, None)

    def process(self, seq: Sequence, new_token_ids: list[int]) -> tuple[RequestOutput, bool]:
        """Returns the output delta and whether a stop string ended the request
        (the caller must then finish the sequence in its engine)."""
        detok = self._detok.get(seq.request_id)
        delta = detok.step(new_token_ids) if detok is not None and new_token_ids else ""
        # A stop string may complete on the same token that ends the sequence
        # (max_tokens, eos): the text is cut there all the same, so it is a stop.
        hit_stop_string = bool(detok is not None and detok.stopped)
        stopped_by_string = hit_stop_string and not seq.is_finished
        finished = seq.is_finished or stopped_by_string
        if finished and detok is not None and not detok.stopped:
            delta += detok.flush()  # text held back as a possible stop-string start
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            text=detok.text if detok is not None else "",
            token_ids=list(seq.output_token_ids),
            delta_text=delta,
            delta_token_ids=list(new_token_ids),
            finished=finished,
            finish_reason="stop" if hit_stop_string else seq.finish_reason,
            error=seq.error,
            logprobs=list(seq.output_logprobs) if seq.output_logprobs else None,
            delta_logprobs=seq.output_logprobs[-len(new_token_ids):] if seq.output_logprobs and new_token_ids else None,
            num_cached_tokens=seq.num_prefix_hit_tokens,
        )
        if hit_stop_string:
            out.stop_reason = detok.stop_string
        elif seq.status == SequenceStatus.FINISHED_STOPPED and seq.output_token_ids:
            out.stop_reason = seq.output_token_ids[-1]
        if finished:
            out.metrics = seq.metrics.as_dict()
            self._detok.pop(seq.request_id, None)
        return out, stopped_by_string
