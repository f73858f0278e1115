"""Property: `kvrelay validate` answers every file with OK or a clear list of problems, never a traceback.

Two sources of input: specs built around the schema (each known field given
a sensible, an extreme or a wrongly typed value), and the deploy/ specs
mutated as text (bytes cut, flipped, inserted; lines duplicated; deep
nesting; non-UTF-8 bytes; anchors and aliases). A spec that validates also
splits into the components' configs (a bound the spec lets through must
not fail later, at serve time).
"""
import contextlib
import io
import math
import os
from pathlib import Path

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cluster.cli import main
from cluster.spec import Spec, SpecError, parse_spec, split_spec

EXAMPLES = 600  # per test
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SPECS = sorted(p.read_bytes() for p in DEPLOY.glob("*.yaml") if p.name != "kuberay-rayjob.yaml")

numbers = (st.integers(-2, 600) | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([0, 1, 16, 2 ** 31, 2 ** 63, 1e308, float("inf"), 1e-300, 0.5, -0.0]))
scalars = st.none() | st.booleans() | numbers | st.text(max_size=12) | st.sampled_from(
    ["1e40", ".inf", "grpc", "nccl", "local", "colocated", "disaggregated", "0.0.0.0", "127.0.0.1", "auto"])
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.text(max_size=8), kids, max_size=3), max_leaves=8)

STAGE = ["replicas", "tensor_parallel_size", "placement_strategy", "placement_timeout_s", "tp_backend",
         "tp_timeout_s", "max_num_seqs", "max_num_batched_tokens", "block_size",
         "num_kv_blocks", "kv_cache_memory_gb", "max_model_len", "enable_prefix_caching", "enforce_eager",
         "kv_cache_prefault"]
SECTIONS = {
    "prefill": STAGE, "decode": STAGE, "colocated": STAGE,
    "transfer": ["backend"], "router": ["policy", "max_queue", "queue_timeout_s", "max_inflight_per_replica", "seed"],
    "frontend": ["host", "grpc_port", "http_port", "health_interval_s"],
    "network": ["host"], "ray": ["address", "namespace"], "auth": ["api_keys", "cluster_secret_env"],
}
OPTIONS = ["lease_s", "deadline_s", "checksum", "connect_timeout_s", "chunk_timeout_s", "max_chunk_bytes",
           "progress_timeout_s", "max_workers", "window", "num_channels", "stream_idle_s"]


def section(fields: list[str]) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional={f: values for f in fields})


ports = st.fixed_dictionaries({}, optional={"first": values, "last": values}) | values
specs = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["SmolLM2-135M-Instruct", "", "x" * 5000]) | values,
    "dtype": st.sampled_from(["auto", "float32", "int4"]) | values,
    "mode": st.sampled_from(["disaggregated", "colocated", "both"]),
    **{name: section(fields) for name, fields in SECTIONS.items()},
    "profile": st.fixed_dictionaries({}, optional={"dir": values, "seconds": values, "delay_s": values}),
}).flatmap(lambda spec: st.builds(lambda options, net, res: _with(spec, options, net, res),
                                  section(OPTIONS), st.fixed_dictionaries({}, optional={
                                      "channel_ports": ports, "kv_ports": ports}),
                                  st.fixed_dictionaries({}, optional={"num_cpus": values, "custom": values})))


def _with(spec: dict, options: dict, network: dict, resources: dict) -> dict:
    spec = dict(spec)
    if options:
        spec["transfer"] = dict(spec.get("transfer", {}), options=options)
    if network:
        spec["network"] = dict(spec.get("network", {}), **network)
    if resources:
        spec["prefill"] = dict(spec.get("prefill", {}), resources=resources)
    return spec


NOT_NUMBERS = {"backend", "policy", "placement_strategy", "tp_backend", "enable_prefix_caching", "enforce_eager", "kv_cache_prefault", "checksum"}


@st.composite
def deploy_specs_with_one_change(draw) -> dict:
    """A deploy/ spec with a few fields set to numbers at and past their bounds: many of these validate."""
    spec = yaml.safe_load(draw(st.sampled_from(SPECS)))
    for _ in range(draw(st.integers(1, 3))):
        unused = {"colocated"} if spec.get("mode", "disaggregated") == "disaggregated" else {"prefill", "decode"}
        name = draw(st.sampled_from(sorted({"prefill", "decode", "colocated", "router", "transfer"} - unused)))
        body = spec.setdefault(name, {}) if isinstance(spec.get(name, {}), dict) else {}
        if name == "transfer":
            body = body.setdefault("options", {})
            field = draw(st.sampled_from([f for f in OPTIONS if f not in NOT_NUMBERS]))
        else:
            field = draw(st.sampled_from([f for f in SECTIONS[name] if f not in NOT_NUMBERS]))
        body[field] = draw(st.integers(1, 64) | st.integers(1, 64) | st.floats(0.5, 100) | numbers | scalars)
    return spec


FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


def check_split(spec: Spec) -> None:
    """A spec that validates splits, and every number in its configs is finite."""
    try:
        config = split_spec(spec)
    except SpecError as e:  # only a secret the spec names and this machine lacks
        assert all(p.startswith("auth") for p in e.problems), e.problems
        return
    for stage in config.stages.values():
        assert stage.num_replicas >= 1 and stage.engine.block_size >= 1
        assert math.isfinite(stage.placement_timeout_s) and stage.engine.tp_timeout_s > 0
    for seconds in (config.router.queue_timeout_s, config.transfer.receiver.lease_s,
                    config.transfer.sender.deadline_s):
        assert math.isfinite(seconds) and seconds > 0


@FUZZ
@given(data=specs | deploy_specs_with_one_change())
def test_every_spec_built_from_the_schema_validates_or_names_its_problems(data):
    text = yaml.safe_dump(data, allow_unicode=True)
    try:
        spec = parse_spec(text)
    except SpecError as e:
        event("invalid")
        assert e.problems and all(": " in p and len(p) < 700 for p in e.problems if not p.startswith("... and "))
        return
    event("valid")
    check_split(spec)


TOKENS = [b":", b"- ", b"{", b"[", b"\n  ", b"&a ", b"*a", b"!!python/name:os.system ", b"? ", b"%YAML 1.1\n",
          b"---\n", b"\t", b"'", b'"', b"<<: ", b"!!binary ", b"!!set "]
NUMBERS = [b"1e40", b".inf", b".nan", b"9" * 5000, b"-0", b"0x7fffffffffffffff", b"1_000", b"0o17", b"2.5", b"1:20"]


@st.composite
def mutated(draw) -> bytes:
    raw = draw(st.sampled_from(SPECS))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["cut", "flip", "insert", "line", "nest", "alias", "bytes", "number"]))
        i = draw(st.integers(0, len(raw)))
        if how == "cut":
            raw = raw[:i] + raw[i + draw(st.integers(1, 40)):]
        elif how == "flip" and i < len(raw):
            raw = raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1:]
        elif how == "insert":
            raw = raw[:i] + draw(st.sampled_from(TOKENS)) + raw[i:]
        elif how == "line":
            lines = raw.split(b"\n")
            j = draw(st.integers(0, len(lines) - 1))
            lines.insert(draw(st.integers(0, len(lines))), lines[j])
            raw = b"\n".join(lines)
        elif how == "nest":
            depth = draw(st.integers(20, 700))
            raw = raw[:i] + b"[" * depth + b"1" + b"]" * depth + raw[i:]
        elif how == "alias":
            raw = b"x0: &x0 [1, 1, 1, 1, 1, 1, 1, 1]\n" + b"".join(
                b"x%d: &x%d [%s]\n" % (k, k, b", ".join([b"*x%d" % (k - 1)] * 8)) for k in range(1, 7)) + raw + \
                b"\nauth: {api_keys: *x6}\n"
        elif how == "bytes":
            raw = raw[:i] + draw(st.binary(min_size=1, max_size=6)) + raw[i:]
        elif how == "number":
            raw = raw[:i] + draw(st.sampled_from(NUMBERS)) + raw[i:]
    return raw


@FUZZ
@given(raw=mutated())
def test_kvrelay_validate_answers_every_mutated_file_ok_or_invalid_without_a_traceback(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("spec", numbered=True) / "spec.yaml"
    path.write_bytes(raw)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["validate", str(path)])
    os.unlink(path)
    event(f"exit {code}")
    if code == 0:
        assert out.getvalue().startswith(f"{path}: OK")
        check_split(parse_spec(raw))
    else:
        assert code == 1 and err.getvalue().startswith(f"{path}: invalid\n  ")
        assert "Traceback" not in err.getvalue() and len(err.getvalue()) < 60_000
