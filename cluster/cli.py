"""The `kvrelay` command line.

    kvrelay validate deploy/local.yaml      check a spec (exit 1 with the errors)
    kvrelay serve deploy/local.yaml         start the cluster it describes
    kvrelay generate "Once upon a time" --max-tokens 32 --stream
    kvrelay chat                            an interactive chat keeping history
    kvrelay status                          replicas, load and KV usage
    kvrelay models                          the served model
    kvrelay profile --seconds 5 --out /tmp/kvrelay-traces   a profiler window on every replica
    kvrelay bench --rates 1,2,4 --out runs/x  a serving benchmark (`cluster.bench`)
    kvrelay bench compare a.json b.json     two benchmark results side by side
    kvrelay bench-engine --write            engine.LLM vs transformers in one process (`engine.bench`)

Client commands talk to ``--target`` (default 127.0.0.1:50051) and send
``--api-key`` (default: the KVRELAY_API_KEY environment variable).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict

DEFAULT_TARGET = "127.0.0.1:50051"


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"host:port of the gRPC frontend ({DEFAULT_TARGET})")
    p.add_argument("--api-key", default=os.environ.get("KVRELAY_API_KEY"), help="default: $KVRELAY_API_KEY")
    p.add_argument("--tls", action="store_true", help="connect with TLS (system roots)")
    p.add_argument("--root-certs", help="PEM file of the roots to trust (implies --tls)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per call")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None, help="default: the rest of the context")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default here) is greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvrelay", description="Disaggregated prefill/decode LLM serving on Ray.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check a cluster spec")
    p.add_argument("spec")
    p.add_argument("--check-secrets", action="store_true", help="also read the auth env vars and files it names")

    p = sub.add_parser("serve", help="start the cluster a spec describes")
    p.add_argument("spec")

    p = sub.add_parser("generate", help="answer a prompt (as a chat turn; --raw for plain completion)")
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true",
                   help="complete the text as is instead of sending it as a user message through the chat template")
    p.add_argument("--stream", action="store_true", help="print text as it arrives")
    p.add_argument("--show-tokens", action="store_true", help="also print token ids and the finish reason")
    _sampling_args(p)
    _client_args(p)

    p = sub.add_parser("chat", help="chat interactively (/reset clears history, /exit or Ctrl-D quits)")
    p.add_argument("--system", help="a system message")
    _sampling_args(p)
    _client_args(p)

    p = sub.add_parser("status", help="replicas, load and KV usage")
    p.add_argument("--json", action="store_true")
    _client_args(p)

    p = sub.add_parser("models", help="the served model")
    _client_args(p)

    p = sub.add_parser("profile", help="record a profiler window on every replica (Chrome traces)",
                       description="Each replica writes <out>/<replica>-<time>.json on its own host "
                                   "(open in chrome://tracing or Perfetto).")
    p.add_argument("--seconds", type=float, default=5.0, help="length of the window (default 5)")
    p.add_argument("--out", required=True, help="folder for the traces, on each replica's host")
    _client_args(p)

    from cluster.bench.cli import add_bench_parser

    add_bench_parser(sub)

    from engine.bench import add_arguments as add_engine_bench_arguments

    p = sub.add_parser("bench-engine", help="the offline engine against transformers' generate (engine.bench)")
    add_engine_bench_arguments(p)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "validate":
        return _validate(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "bench":
        from cluster.bench.cli import main as bench_main

        return bench_main(args)
    if args.command == "bench-engine":
        from engine.bench import run as bench_engine

        words = list(sys.argv[1:] if argv is None else argv)
        return bench_engine(args, command=" ".join(["kvrelay", *words]))
    from cluster.client import KVRelayError

    try:
        return {"generate": _generate, "chat": _chat, "status": _status, "models": _models,
                "profile": _profile}[args.command](args)
    except KVRelayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _validate(args: argparse.Namespace) -> int:
    from cluster.spec import SpecError, load_spec, split_spec

    try:
        spec = load_spec(args.spec)
        if args.check_secrets:
            split_spec(spec)
        if any(s.num_ranks > 1 or s.pipeline_layer_split for s in spec.stages().values()):
            _check_model(spec)
    except SpecError as e:
        print(f"{args.spec}: invalid", file=sys.stderr)
        for problem in e.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    stages = ", ".join(f"{s.value} x{st.replicas}" for s, st in spec.stages().items())
    print(f"{args.spec}: OK ({spec.mode}: {stages}; transfer {spec.transfer.backend}; router {spec.router.policy})")
    return 0


def _check_model(spec) -> None:
    """The spec against its model's config (tensor_parallel_size must split the heads, a
    pipeline_layer_split sum to the layers), where
    the model is at hand here; a model this host cannot read is left to `serve`."""
    from engine.weights import read_config, resolve_model

    try:
        model_config = read_config(resolve_model(spec.model))
    except Exception as e:  # noqa: BLE001 - not a model here: validated where it is served
        print(f"note: model {spec.model!r} not read here ({type(e).__name__}); tensor_parallel_size "
              "and pipeline_layer_split are checked against it at serve", file=sys.stderr)
        return
    spec.check_model(model_config)


def _serve(args: argparse.Namespace) -> int:
    from cluster.spec import SpecError, load_spec

    try:
        spec = load_spec(args.spec)
    except SpecError as e:
        print(str(e), file=sys.stderr)
        return 1
    from cluster.launcher import serve  # lazily: it pulls in Ray and the engine

    return serve(spec) or 0


def _client(args: argparse.Namespace):
    from cluster.client import KVRelayClient

    return KVRelayClient(args.target, api_key=args.api_key, timeout=args.timeout, tls=args.tls,
                         root_certificates=args.root_certs)


def _sampling(args: argparse.Namespace) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)


def _generate(args: argparse.Namespace) -> int:
    prompt = {"prompt": args.prompt} if args.raw else {"messages": [{"role": "user", "content": args.prompt}]}
    with _client(args) as client:
        if args.stream:
            token_ids, finish = [], None
            for chunk in client.stream(**prompt, **_sampling(args)):
                print(chunk.text, end="", flush=True)
                token_ids.extend(chunk.token_ids)
                finish = chunk.finish_reason or finish
            print()
        else:
            result = client.generate(**prompt, **_sampling(args))
            print(result.text)
            token_ids, finish = result.token_ids, result.finish_reason
    if args.show_tokens:
        print(f"[{len(token_ids)} tokens, finish: {finish.value if finish else 'none'}] {token_ids}")
    return 0


def _chat(args: argparse.Namespace) -> int:
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    base = len(history)
    with _client(args) as client:
        while True:
            try:
                line = input("you> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if line.strip() in ("/exit", "/quit"):
                return 0
            if line.strip() == "/reset":
                del history[base:]
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            print("assistant> ", end="", flush=True)
            reply = []
            try:
                for chunk in client.stream(messages=history, **_sampling(args)):
                    print(chunk.text, end="", flush=True)
                    reply.append(chunk.text)
            except Exception:
                history.pop()  # keep the history consistent for the next turn
                print()
                raise
            print()
            history.append({"role": "assistant", "content": "".join(reply)})


_LOAD_FIELDS = ("num_running_seqs", "num_queued_prefill_tokens", "num_in_flight", "num_free_blocks",
                "num_total_blocks")


def _status(args: argparse.Namespace) -> int:
    """A dead replica's load is shown as unknown ("-", null in JSON): its last report is not its load now."""
    with _client(args) as client:
        status = client.status()
    if args.json:
        out = asdict(status)
        for r in out["replicas"]:
            if not r["is_alive"]:
                r.update(dict.fromkeys(_LOAD_FIELDS))
        print(json.dumps(out, default=lambda o: getattr(o, "value", str(o)), indent=2))
        return 0
    print(f"model {status.model_name} ({status.mode}), {status.num_waiting} waiting")
    print(f"{'replica':<16} {'stage':<10} {'tp x pp':>7} {'alive':<6} {'state':<10} {'running':>7} {'queued tok':>10} "
          f"{'in flight':>9} {'KV used':>8} {'restarts':>8} {'weights/kernels':<16}")
    for r in status.replicas:
        runs = f"{r.quantization or '?'}/{r.kernel_isa or '?'}"  # e.g. gguf/avx2; ?: an older server
        par = f"{r.tensor_parallel_size}x{r.pipeline_parallel_size}"
        if not r.is_alive:
            state = "down" if r.state == "serving" else r.state  # the router took it out; no watcher said why
            print(f"{r.replica_id:<16} {r.stage.value:<10} {par:>7} {'NO':<6} {state:<10} {'-':>7} {'-':>10} {'-':>9} "
                  f"{'-':>8} {r.num_restarts:>8} {runs:<16}" + (f"   last error: {r.last_error}" if r.last_error else ""))
            continue
        kv = f"{r.kv_usage:.0%}" if r.num_total_blocks else "-"
        ranks = f"   ranks (pid): {' '.join(map(str, r.rank_pids))}" if len(r.rank_pids) > 1 else ""
        print(f"{r.replica_id:<16} {r.stage.value:<10} {par:>7} {'yes':<6} {r.state:<10} "
              f"{r.num_running_seqs:>7} {r.num_queued_prefill_tokens:>10} {r.num_in_flight:>9} {kv:>8} "
              f"{r.num_restarts:>8} {runs:<16}" + ranks)
    return 0


def _models(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for m in client.list_models():
            print(f"{m.id}\tcontext {m.max_model_len}\tvocab {m.vocab_size}"
                  + (f"\ttokenizer {m.tokenizer_dir}" if m.tokenizer_dir else ""))
    return 0


def _profile(args: argparse.Namespace) -> int:
    with _client(args) as client:
        traces = client.profile(args.seconds, args.out)
    for t in traces:
        print(f"{t.replica_id or '-'}\t{t.host or '-'}\t{t.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
