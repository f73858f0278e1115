"""Tokenization, chat templates and streaming detokenization.

`Tokenizer` wraps a checkpoint folder's fast tokenizer (transformers), so
encoding, decoding and chat templates behave exactly as the model's authors
defined them. `IncrementalDetokenizer` turns a stream of generated token ids
into a stream of text deltas, holding back bytes of an unfinished UTF-8
character and text that may be the start of a stop string.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence


class TokenizerError(ValueError):
    """A checkpoint's tokenizer is missing or cannot do what was asked."""


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _json_file(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot be read as JSON ({e})") from e
    return data if isinstance(data, dict) else {}


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_token_ids: Iterable[int] = (), source: str = "") -> None:
        self._tok = hf_tokenizer
        self._source = source
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.eos_token_ids: set[int] = set(_ids(hf_tokenizer.eos_token_id)) | set(eos_token_ids)
        # Tokens the tokenizer knows, added ones included; a model's embedding may be larger.
        self.vocab_size: int = len(hf_tokenizer)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "Tokenizer":
        """The tokenizer of a checkpoint folder; its end-of-sequence ids gather the
        tokenizer's, config.json's and generation_config.json's."""
        from transformers import AutoTokenizer

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json or tokenizer_config.json in this checkpoint")
        try:
            hf = AutoTokenizer.from_pretrained(str(folder), use_fast=True)
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{folder}: cannot load the tokenizer ({e})") from e
        eos: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            eos |= set(_ids(_json_file(folder / name).get("eos_token_id")))
        return cls(hf, eos, source=str(folder))

    @property
    def hf(self):
        """The transformers tokenizer underneath (the grammar engine builds its vocabulary from it)."""
        return self._tok

    @property
    def chat_template(self) -> str:
        """The checkpoint's chat template text ("" when it has none)."""
        template = getattr(self._tok, "chat_template", None) or ""
        return template if isinstance(template, str) else json.dumps(template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: list[dict] | None = None) -> str:
        """The prompt text for a conversation, per the checkpoint's chat template
        (which receives ``tools``, OpenAI's function definitions, when given)."""
        if not getattr(self._tok, "chat_template", None):
            raise TokenizerError(
                f"{self._source or 'this tokenizer'}: the checkpoint has no chat template; "
                "send a plain prompt instead of messages"
            )
        return self._tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            **({"tools": tools} if tools else {}),
        )


# Token ids of the prompt decoded before the first output token, so that the
# first output token is decoded in context (a leading space survives).
_PROMPT_CONTEXT = 5
# Past this many pending ids, look back for an earlier id boundary that ends
# a whole character and move the window there.
_MAX_PENDING = 16
# Past this many pending ids, the bytes are taken as invalid rather than
# unfinished: emit them (as U+FFFD) and move on, to bound the window.
_MAX_WINDOW = 64


class IncrementalDetokenizer:
    """Output token ids in, text deltas out.

    Decodes only a window of recent ids (O(window) per step): a few ids of
    context whose text is already out, then the pending ids. Decoding both and
    cutting off the context's text leaves the pending text (with any leading
    space the context implies); all of it but an unfinished character at its
    end (U+FFFD while bytes are missing) is emitted. The window moves on to an
    id boundary that ends a whole character: the end when it does, else, once
    many ids are pending, the latest earlier one.

    Text that could be the start of a stop string is held back; when a stop
    string appears, `stopped` is set, the output ends just before it (after
    it with ``include_stop``) and later steps return "". Stop strings are
    looked for only once ``min_tokens`` output tokens have been stepped in
    (vLLM's min_tokens; text out before then is not searched). Call `flush()`
    when the stream ends to get whatever is still held back.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] = (), include_stop: bool = False,
                 min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._include_stop, self._min_tokens, self._num_tokens = include_stop, min_tokens, 0
        # Window of ids: the first `_read` are context, already decoded; the rest are pending.
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._read = len(self._ids)
        self._emitted = 0  # chars of the pending ids' text already emitted
        self._held = ""  # emitted-ready text that may begin a stop string
        self._chunks: list[str] = []  # emitted text
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the output

    @property
    def text(self) -> str:
        """All text emitted so far (the deltas joined)."""
        return "".join(self._chunks)

    def step(self, new_token_ids: Iterable[int]) -> str:
        """Add output tokens; return the text they complete (possibly "")."""
        if self.stopped:
            return ""
        new_token_ids = list(new_token_ids)
        self._ids.extend(new_token_ids)
        self._num_tokens += len(new_token_ids)
        return self._release(self._decode_new(final=False))

    def flush(self) -> str:
        """End of stream: return the text still held back (pending bytes, stop-string prefixes)."""
        if self.stopped:
            return ""
        delta = self._release(self._decode_new(final=True))
        if self.stopped:
            return delta
        delta += self._held
        self._chunks.append(self._held)
        self._held = ""
        return delta

    def _decode_new(self, final: bool) -> str:
        decode = self._tokenizer.decode
        context_len = len(decode(self._ids[:self._read], self._skip_special))
        pending = decode(self._ids, self._skip_special)[context_len:]
        num_pending = len(self._ids) - self._read
        done = final or num_pending >= _MAX_WINDOW
        stable = pending if done else pending.rstrip("\ufffd")
        delta = stable[self._emitted:]
        self._emitted = max(self._emitted, len(stable))
        if done or (pending and not pending.endswith("\ufffd")):
            self._advance(len(self._ids), len(pending))
        elif num_pending >= _MAX_PENDING:
            for end in range(len(self._ids) - 1, self._read, -1):
                head = decode(self._ids[:end], self._skip_special)[context_len:]
                if head and not head.endswith("\ufffd") and len(head) <= self._emitted:
                    self._advance(end, len(head))
                    break
        return delta

    def _advance(self, end: int, num_chars: int) -> None:
        """Make ids[read:end], whose text (num_chars long) is out, the new context."""
        del self._ids[:self._read]
        self._read = end - self._read
        self._emitted -= num_chars

    def _release(self, delta: str) -> str:
        if not delta and not self._held:
            return ""
        buf = self._held + delta
        if self._num_tokens < self._min_tokens:  # too early to stop: nothing to look for, nothing to hold
            out, self._held = buf, ""
        elif (cut := self._first_stop(buf)) is not None:
            self.stopped = True
            self.stop_string = min((s for s in self._stop if buf.find(s) == cut), key=len)
            out, self._held = buf[:cut + (len(self.stop_string) if self._include_stop else 0)], ""
        else:
            keep = self._stop_prefix_len(buf)
            out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        if out:
            self._chunks.append(out)
        return out

    def _first_stop(self, buf: str) -> int | None:
        found = [i for i in (buf.find(s) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest end of `buf` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
