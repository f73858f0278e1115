"""Reading a spec file's YAML without trusting it: `read_yaml`.

Every way a file can be wrong is a `SpecError` naming the file: larger than
MAX_SPEC_BYTES, not UTF-8, not YAML, nested deeper than MAX_YAML_DEPTH
(checked on the parser's events, before PyYAML's recursive composer could
raise RecursionError), or holding a value Python cannot read (an integer of
thousands of digits). What it returns is plain data for `Spec` to validate.
"""
from __future__ import annotations

from typing import Any

import yaml

from cluster.errors import clip
from cluster.spec_errors import SpecError

MAX_YAML_DEPTH = 32  # the spec itself is 4 deep
MAX_SPEC_BYTES = 1 << 20


def read_yaml(raw: bytes | str, source: str | None = None) -> Any:
    """The data of a spec's YAML text (None for an empty file); raises SpecError."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError([f"(file): larger than {MAX_SPEC_BYTES} bytes; a spec is a few hundred"], source)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise SpecError([f"(file): not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start} (line {line})"],
                        source) from None
    try:
        _check_depth(text)
        return yaml.safe_load(text)
    except SpecError as e:
        raise SpecError(e.problems, source) from None
    except yaml.YAMLError as e:
        raise SpecError([f"not valid YAML: {clip(str(e), 512)}"], source) from None
    except ValueError as e:  # an integer past Python's limit on digits
        raise SpecError([f"not a usable YAML value: {clip(str(e).split(';')[0], 200)}"], source) from None
    except RecursionError:
        raise SpecError(["(file): nested too deeply to read"], source) from None


def _check_depth(text: str) -> None:
    """Refuse YAML nested deeper than MAX_YAML_DEPTH, naming where; before anything recursive reads it.

    PyYAML's parser is iterative; its composer and constructor recurse, and
    past ~500 levels raise RecursionError.
    """
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                mark = event.start_mark
                raise SpecError([f"(file): nested deeper than {MAX_YAML_DEPTH} levels at line {mark.line + 1}, "
                                 f"column {mark.column + 1}"])
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
