"""Guided decoding: a request's output constrained to a JSON schema, a regex,
a list of choices or a grammar, by a token mask at every sampled position.

The grammar engine is xgrammar (BENCHMARKS.md, "Guided decoding", says why
it and not llguidance). Three pieces:

- `GuidedSpec`: what the output must match, a plain frozen record that
  rides in `SamplingParams` through every frame and process; `check_spec`
  parses it without a tokenizer (cheap: the frontends call it to refuse a
  bad schema with the problem named).
- `GrammarCompiler`: one per replica. Compiles specs against the model's
  vocabulary on a thread pool, never on the engine loop, and caches the
  compiled grammars by spec. `compile` returns a Future.
- `GrammarState`: one per guided sequence, the matcher. It is built from
  the compiled grammar and the sequence's output tokens so far, so a request
  that moves (a decode replica admitting a prefilled sequence with its first
  token, a request resumed elsewhere after its replica died) rebuilds the
  grammar's state from its tokens. A preempted sequence keeps its state: it
  recomputes its KV, not its tokens.

`apply_masks` writes the masks of the guided rows of a batch's logits, in
place (torch ops); rows without a grammar are not touched.
"""
from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CACHED_GRAMMARS = 256


class GuidedError(ValueError):
    """A spec the grammar engine cannot take; ``str(err)`` names the problem."""


@dataclass(frozen=True)
class GuidedSpec:
    """What a request's output must match.

    ``kind``: ``json`` (``value`` is a JSON schema as JSON text),
    ``json_object`` (any JSON object; ``value`` unused), ``regex``
    (``value`` the pattern), ``choice`` (``choices``: the output is exactly
    one of them), ``grammar`` (``value`` an EBNF grammar in the GBNF
    dialect: ``root ::= ...``).
    """

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GuidedError(f"kind: must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise GuidedError("choice: must be a non-empty list of non-empty strings")
        elif self.kind != "json_object" and not (isinstance(self.value, str) and self.value):
            raise GuidedError(f"{self.kind}: must not be empty")

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> GuidedSpec:
        """A JSON schema as a dict or JSON text (compacted, so equal schemas share a cache entry)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GuidedError(f"json: the schema is not valid JSON ({e})") from None
        return cls("json", json.dumps(schema, separators=(",", ":")))

    def describe(self) -> str:
        return f"{self.kind}" + (f" of {len(self.choices)} choices" if self.kind == "choice" else "")


def _choice_grammar(choices: Sequence[str]) -> str:
    # EBNF string literals take JSON's escapes
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _json_safe_lengths(schema):
    """``schema`` with string length bounds written as a pattern.

    xgrammar 0.2.8 compiles ``minLength``/``maxLength`` to a character class
    that lets raw control characters (a tab, say) into the string, which
    makes the output invalid JSON; the same bounds as a pattern exclude them.
    (Either way the string holds no escapes.) A string that already has a
    pattern, a format, an enum or a const keeps its bounds.
    """
    if isinstance(schema, list):
        return [_json_safe_lengths(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _json_safe_lengths(v) for k, v in schema.items()}
    bounds = ("minLength" in out or "maxLength" in out) and out.get("type") == "string"
    if bounds and not {"pattern", "format", "enum", "const"} & out.keys():
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{high}}}$'
    return out


def _grammar(spec: GuidedSpec):
    """The tokenizer-free xgrammar.Grammar of ``spec``; raises GuidedError naming the problem."""
    import xgrammar as xgr

    try:
        if spec.kind == "json":
            schema = json.dumps(_json_safe_lengths(json.loads(spec.value)))
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_grammar(spec.choices))
        return xgr.Grammar.from_ebnf(spec.value)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError/its own types with the parser's message
        raise GuidedError(f"{spec.kind}: cannot be compiled: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return re.sub(r"\s+", " ", text)[:300]


def check_spec(spec: GuidedSpec) -> None:
    """Raises GuidedError if the grammar engine cannot take ``spec`` (no tokenizer needed)."""
    _grammar(spec)


class GrammarCompiler:
    """Compiles specs against one model's vocabulary, off the caller's thread,
    and keeps the compiled grammars (by spec, least recently used dropped past
    ``MAX_CACHED_GRAMMARS``).

    ``hf_tokenizer``: the checkpoint's transformers tokenizer; ``vocab_size``:
    the model's (the logits' width, which may exceed the tokenizer's);
    ``stop_token_ids``: the ids that end a sequence (a finished grammar
    allows only these).
    """

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Iterable[int], num_threads: int = 1):
        self._tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(set(stop_token_ids))
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: dict[GuidedSpec, Future] = {}
        self._compiler = None  # xgrammar.GrammarCompiler, built by the first compile (on the pool)

    def compile(self, spec: GuidedSpec) -> Future:
        """A Future of the compiled grammar (done at once on a cache hit); its
        exception is a GuidedError naming the problem."""
        with self._lock:
            fut = self._cache.pop(spec, None)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut  # most recently used last
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.pop(next(iter(self._cache)))
        return fut

    def _compile(self, spec: GuidedSpec):
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        grammar = _grammar(spec)
        try:
            return self._compiler.compile_grammar(grammar)
        except Exception as e:
            raise GuidedError(f"{spec.kind}: cannot be compiled: {_first_line(e)}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, compiled, output_token_ids: Sequence[int] = ()):
        """Raises GuidedError if the tokens so far do not match the grammar."""
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        for i, token in enumerate(output_token_ids):
            if not self.accept(token):
                raise GuidedError(f"output token {i} (id {token}) does not match the grammar")

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and took its stop token: nothing more may follow."""
        return self._matcher.is_terminated()

    def fill(self, bitmask, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def apply_masks(logits, states: Sequence[GrammarState], rows: Sequence[int]) -> None:
    """Mask ``logits`` in place: row ``rows[i]`` keeps only the tokens ``states[i]`` allows.

    logits: [N, V] float; rows: indices into N (the guided rows only; the others are not touched).
    """
    import xgrammar as xgr

    # [R, ceil(V/32)] int32: bit j of word w allows token 32w + j
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    for i, state in enumerate(states):
        state.fill(bitmask, i)
    apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True), rows)


_BITS: dict = {}  # device -> [32] int32 shifts


def apply_bitmask(logits, bitmask, rows: Sequence[int]) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is 0, in place (torch ops: this costs a
    fraction of xgrammar's own CPU apply, BENCHMARKS.md "Guided decoding").

    logits: [N, V] float; bitmask: [len(rows), ceil(V/32)] int32 on logits' device.
    """
    import torch

    shifts = _BITS.get(logits.device)
    if shifts is None:
        shifts = _BITS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    num_rows, vocab = len(rows), logits.shape[1]
    banned = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(num_rows, -1)[:, :vocab] == 0  # [R, V] bool
    if num_rows == logits.shape[0] and list(rows) == list(range(num_rows)):
        logits.masked_fill_(banned, float("-inf"))
        return
    index = torch.tensor(list(rows), device=logits.device)
    logits[index] = logits[index].masked_fill_(banned, float("-inf"))
