"""A spec's problems, each as ``"<dotted.path>: <message>"``: `SpecError` and pydantic's errors in that form.

Messages quote the input shortly (`cluster.errors.quote`) and a SpecError
lists at most MAX_PROBLEMS of them, so an error stays readable whatever the
file holds.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from cluster.errors import clip, quote

MAX_PROBLEMS = 50  # a SpecError lists at most this many, then how many more


class SpecError(ValueError):
    """The spec is invalid. ``problems`` holds one ``"<path>: <message>"`` per error."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        head = f"invalid cluster spec {source}" if source else "invalid cluster spec"
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in problems))


def format_errors(err: ValidationError) -> list[str]:
    """pydantic's errors as ``"<dotted.path>: <message>"`` lines."""
    out = []
    found = err.errors(include_url=False)
    for e in found[:MAX_PROBLEMS]:
        path = clip(".".join(str(p) for p in e["loc"]), 200)
        if not path and e["type"] == "value_error":  # a whole-spec check; its lines carry their paths
            out.extend(_message(e).splitlines())
        else:
            out.append(f"{path or '(top level)'}: {_message(e)}")
    if len(found) > MAX_PROBLEMS:
        out.append(f"... and {len(found) - MAX_PROBLEMS} more problems")
    return out


def _message(e: dict[str, Any]) -> str:
    kind, ctx = e["type"], e.get("ctx") or {}
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">",
              "less_than_equal": "<=", "less_than": "<"}[kind]
        bound = next(iter(ctx.values()))
        bound = f"{bound:g}" if isinstance(bound, float) else bound
        return f"must be {op} {bound}, got {quote(e['input'])}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {quote(e['input'])}"
    if kind == "value_error":
        return clip(str(ctx.get("error", e["msg"])), 512)
    if kind in ("int_type", "float_type") and isinstance(e.get("input"), str) and _is_number(e["input"]):
        what = "an integer" if kind == "int_type" else "a number"
        return f"must be {what}, got the string {quote(e['input'])} (YAML 1.1 reads 1e40 as text: write 1.0e+40)"
    return f"{e['msg'][:1].lower()}{e['msg'][1:]}, got {quote(e['input'])}" if "input" in e else e["msg"]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
