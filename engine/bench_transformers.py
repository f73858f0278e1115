"""The transformers baseline of `engine.bench`: ``generate`` on the same prompts, on torch's own
choice of kernels or, in a fresh process, held to AVX2 (what an AVX2-only CPU's torch runs); and
the figures record both sides fill."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

WARMUP_TOKENS = 16
# torch held to AVX2 and FMA, as on a CPU without AVX-512: ATen's vectorized kernels and oneDNN's
# (set before torch loads, so only in a fresh process; torch.backends.cpu.get_cpu_capability() says
# whether it took)
TORCH_AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@dataclass
class Figures:
    decode_tok_s: float
    ttft_s: float
    batch_tok_s: float


def _hf_generate(model, ids: list[list[int]], new: int) -> float:
    import torch

    x = torch.tensor(ids)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - t0
    assert out.shape[1] == x.shape[1] + new
    return wall


def bench_transformers(model, prompt: list[int], batch: list[list[int]], new: int) -> Figures:
    _hf_generate(model, [prompt], WARMUP_TOKENS)
    _hf_generate(model, batch, WARMUP_TOKENS)
    ttft = statistics.median(_hf_generate(model, [prompt], 1) for _ in range(3))
    total = _hf_generate(model, [prompt], new)
    wall = _hf_generate(model, batch, new)
    return Figures((new - 1) / (total - ttft), ttft, len(batch) * new / wall)


def torch_capability() -> str:
    """The vector ISA torch's own CPU kernels run here (AVX512, AVX2, DEFAULT, ...)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def baseline_label(capability: str) -> str:
    return f"transformers (torch {capability})"


def run_transformers(model_dir, dtype: str, prompt: list[int], batch: list[list[int]], new: int) -> Figures:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    return bench_transformers(hf, prompt, batch, new)


def bench_transformers_avx2(args, model_dir, prompt: list[int], batch: list[list[int]]) -> Figures:
    """The transformers baseline in a fresh process with torch held to AVX2
    (TORCH_AVX2_ENV), on the same prompts and thread count; raises if torch
    did not take the restriction."""
    with tempfile.TemporaryDirectory() as d:
        prompts = Path(d) / "prompts.json"
        prompts.write_text(json.dumps({"prompt": prompt, "batch": batch}))
        cmd = [sys.executable, "-m", "engine.bench", "--model", str(model_dir), "--dtype", args.dtype,
               "--new-tokens", str(args.new_tokens), "--transformers-only", str(prompts)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        done = subprocess.run(cmd, env={**os.environ, **TORCH_AVX2_ENV}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the AVX2 transformers baseline failed (exit {done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["capability"] != "AVX2":
        raise RuntimeError(f"the AVX2 transformers baseline ran on torch's {result['capability']} kernels: "
                           f"{', '.join(f'{k}={v}' for k, v in TORCH_AVX2_ENV.items())} did not take")
    return Figures(**result["figures"])


def transformers_only(args, model_dir) -> int:
    """The child of bench_transformers_avx2: one line of JSON on stdout."""
    prompts = json.loads(args.transformers_only.read_text())
    figures = run_transformers(model_dir, args.dtype, prompts["prompt"], prompts["batch"], args.new_tokens)
    print(json.dumps({"capability": torch_capability(), "figures": asdict(figures)}))
    return 0
