"""Mixture of experts on CPU: a decode step at one rank, TP=2 and EP=2, and the grouped
expert matmul against a dense matmul of the same FLOPs.

    python -m engine.moe_bench            # print the figures (markdown)
    python -m engine.moe_bench --decode   # only the decode-step table

A random Mixtral-shaped checkpoint (bf16): hidden 1024, 8 experts of 1024 columns, top-2,
4 layers, 16 heads of 64 (4 KV heads), vocabulary 8192.

1. A decode step of batch 1 and 16 (prompts of 32 tokens) through engine.LLM at one rank,
   TP=2 without expert parallelism and TP=2 with it (EP=2), under each moe_dispatch, split on
   rank 0 into expert compute (the sparse MLPs less their collectives: routing, gather, the
   experts' matmuls, combine by index_add), dispatch/combine (the collectives of the sparse
   layers, engine/parallel/moe.py: ``allreduce``'s all-reduce; ``alltoall``'s count exchange,
   two all-to-alls and the all-gather) and the rest.
2. The grouped expert compute (MoEBlock.forward, bf16 native kernels) for M tokens against
   one dense MLP matmul pair on M x top_k rows: the same FLOPs, but the dense one reads one
   expert's weights where the grouped one reads every expert a token picked.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

H, I, E, K, LAYERS, VOCAB = 1024, 1024, 8, 2, 4, 8192


def make_checkpoint(folder: Path) -> Path:
    from safetensors.torch import save_file

    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": VOCAB,
           "hidden_size": H, "intermediate_size": I, "num_hidden_layers": LAYERS, "num_attention_heads": 16,
           "num_key_value_heads": 4, "head_dim": 64, "num_local_experts": E, "num_experts_per_tok": K,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 1024, "tie_word_embeddings": False}
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones():
        return torch.ones(H, dtype=torch.bfloat16)

    w = {"model.embed_tokens.weight": rnd(VOCAB, H), "model.norm.weight": ones(), "lm_head.weight": rnd(VOCAB, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones(),
                  p + "self_attn.q_proj.weight": rnd(H, H), p + "self_attn.k_proj.weight": rnd(256, H),
                  p + "self_attn.v_proj.weight": rnd(256, H), p + "self_attn.o_proj.weight": rnd(H, H),
                  p + "block_sparse_moe.gate.weight": rnd(E, H) * 50})  # * 50: a router that spreads tokens
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            w.update({q + "w1.weight": rnd(I, H), q + "w3.weight": rnd(I, H), q + "w2.weight": rnd(H, I)})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(w, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def decode_step(model_dir: Path, batch: int, tp: int, ep: bool, dispatch: str = "allreduce",
                new_tokens: int = 24) -> dict:
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, VOCAB, (32,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), dtype="bfloat16", num_kv_blocks=128, enable_prefix_caching=False,
             tensor_parallel_size=tp, enable_expert_parallel=ep, moe_dispatch=dispatch) as llm:
        model = llm.core.model
        llm.generate(prompts[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        moe = model.expert_dispatch
        for p in prompts:
            llm.add_request(p, params)
        llm.step()  # every prompt's prefill in one batch
        steps, expert_s, combine_s = [], [], []
        while llm.has_unfinished():
            m0, c0, t0 = moe.total_s, moe.combine_s, time.perf_counter()
            llm.step()
            steps.append(time.perf_counter() - t0)
            expert_s.append(moe.total_s - m0 - (moe.combine_s - c0))
            combine_s.append(moe.combine_s - c0)
        mid = sorted(range(len(steps)), key=steps.__getitem__)[len(steps) // 2]  # the median step
        return {"step_ms": steps[mid] * 1e3, "expert_ms": expert_s[mid] * 1e3, "combine_ms": combine_s[mid] * 1e3,
                "rest_ms": (steps[mid] - expert_s[mid] - combine_s[mid]) * 1e3, "threads": torch.get_num_threads(),
                "ops": type(model.ops).__name__}


def grouped_vs_dense(tokens: int, iters: int = 30) -> dict:
    """MoEBlock.forward on `tokens` random tokens (bf16, native kernels) against a dense gate|up +
    down on tokens * top_k rows through one expert's weights (the same FLOPs)."""
    from engine.config import ModelConfig
    from engine.kernels import PackedWeight, make_ops
    from engine.moe import MoEBlock, expert_name

    ops = make_ops(torch.bfloat16, torch.device("cpu"))
    cfg = ModelConfig("mixtral", VOCAB, H, I, 1, 16, 4, 64, num_experts=E, num_experts_per_tok=K,
                      moe_intermediate_size=I, moe_layers=(0,))
    g = torch.Generator().manual_seed(0)
    ws = {"model.layers.0.mlp.gate.weight": torch.randn(E, H, generator=g)}
    for e in range(E):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            ws[expert_name(0, e, proj)] = torch.randn(*shape, generator=g) * 0.02
    block = MoEBlock(cfg, 0, tuple(range(E)), I, 0, lambda n, s: ws[n].to(torch.bfloat16).contiguous())
    if ops.packs_weights:
        block.map_weights(PackedWeight.pack)
    gu, dn = block.gate_up_w[0], block.down_w[0]
    h = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    x = torch.randn(tokens * K, H, generator=g).to(torch.bfloat16)

    def time_it(fn) -> float:
        fn()
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    grouped = time_it(lambda: block.forward(h, ops))
    dense = time_it(lambda: ops.linear(ops.silu_mul(ops.linear(x, gu)), dn))
    _, counts = block.forward(h, ops)
    flops = 2 * tokens * K * 3 * H * I
    active = int((counts > 0).sum())
    expert_bytes = 3 * H * I * 2  # one expert's gate, up and down in bf16
    return {"tokens": tokens, "grouped_ms": grouped * 1e3, "dense_ms": dense * 1e3, "ratio": grouped / dense,
            "active_experts": active, "grouped_mb": active * expert_bytes / 1e6, "dense_mb": expert_bytes / 1e6,
            "grouped_gbps": active * expert_bytes / grouped / 1e9, "grouped_gflops": flops / grouped / 1e9,
            "dense_gflops": flops / dense / 1e9, "ops": type(ops).__name__}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv: list[str]) -> int:
    flags = Path("/proc/cpuinfo").read_text()
    print(f"CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} cores; avx512_bf16: {'avx512_bf16' in flags}, "
          f"avx2: {' avx2' in flags}; load average before: {os.getloadavg()[0]:.1f}")
    if argv not in ([], ["--decode"]):
        print(f"usage: python -m engine.moe_bench [--decode]; got {' '.join(argv)}", file=sys.stderr)
        return 2
    if not argv:
        grouped_table()
    decode_table()
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    return 0


def grouped_table() -> None:
    print("\n| tokens | active experts | grouped (ms) | dense, same FLOPs (ms) | grouped / dense "
          "| weights read, grouped / dense (MB) | grouped GB/s | grouped GFLOP/s | dense GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    torch.set_num_threads(1)  # one thread: the grouped path's many small ops pay no OpenMP barrier
    for t in (1, 16, 256):
        r = grouped_vs_dense(t, iters=30 if t <= 16 else 10)
        print(f"| {t} | {r['active_experts']} | {r['grouped_ms']:.3f} | {r['dense_ms']:.3f} | {r['ratio']:.2f}x "
              f"| {r['grouped_mb']:.1f} / {r['dense_mb']:.1f} | {r['grouped_gbps']:.1f} | {r['grouped_gflops']:.1f} "
              f"| {r['dense_gflops']:.1f} |", flush=True)


def decode_table() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(Path(tmp) / "moe")
        print("\n| batch | layout | step (ms) | expert compute (ms) | dispatch/combine (ms) | rest (ms) | threads/rank |")
        print("|---|---|---|---|---|---|---|")
        for batch in (1, 16):
            for name, tp, ep, dispatch, threads in (
                    ("one rank", 1, False, "allreduce", 2), ("one rank, 1 thread", 1, False, "allreduce", 1),
                    ("TP=2", 2, False, "allreduce", 1), ("EP=2 allreduce", 2, True, "allreduce", 1),
                    ("EP=2 alltoall", 2, True, "alltoall", 1)):
                torch.set_num_threads(threads)  # (TP=2: each rank takes 1 of the 2 cores itself)
                r = decode_step(model_dir, batch, tp, ep, dispatch)
                print(f"| {batch} | {name} | {r['step_ms']:.2f} | {r['expert_ms']:.2f} | {r['combine_ms']:.2f} | "
                      f"{r['rest_ms']:.2f} | {r['threads']} |", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
