"""A fused decode step of several threads runs as one team (engine/csrc/ops.h Team,
decode_step.cpp): every thread runs the whole step, a share of each matmul's blocks and of
attention's items, and they meet at barriers instead of forking and joining per op. It must
compute what one thread computes, bit for bit, in every weight format, whatever the thread count
(more threads than cores, than a matrix has blocks), and a bad setting is refused by name."""
from __future__ import annotations

import re

import pytest
import torch

from engine.kernels import load_native_ops
from tests.engine.test_kernels import _decode_batch

# (team, bytes of the next matrix fetched while waiting): the per-op joins, and the team
SETTINGS = [(False, 0), (True, 0), (True, 64 << 10), (True, 1 << 20)]


@pytest.fixture
def team_ext(request):
    """A kernel module whose team setting a test changes, put back afterwards."""
    exts = []

    def get(isa):
        ext = load_native_ops(isa)
        exts.append((ext, ext.decode_team()))
        return ext

    yield get
    for ext, setting in exts:
        ext.set_decode_team(*setting)


def _steps(model, kv_caches, lens, ext):
    """The fused step of one batch at 1, 2 and 3 threads under each setting: {(threads, setting):
    (hidden states, KV caches after)}; every run starts from the same caches."""
    ids, pos, meta = _decode_batch(model, kv_caches, lens)
    x = model.embed_tokens(ids)
    out = {}
    pool = torch.get_num_threads()
    torch.set_num_threads(3)  # (a team takes at most the pool's threads: 3, more than CI's cores)
    try:
        for setting in SETTINGS:
            ext.set_decode_team(*setting)
            assert ext.decode_team() == setting
            for threads in (1, 2, 3):
                kv = [c.clone() for c in kv_caches]
                y = model.fused.forward(x, pos, meta.slot_blocks, meta.slot_offsets, meta.decode_block_tables,
                                        meta.decode_context_lens, kv, threads)
                out[threads, setting] = (y.clone(), kv)
    finally:
        torch.set_num_threads(pool)
    return out


def _assert_all_equal(out):
    (ref_y, ref_kv), *rest = out.values()
    for key, (y, kv) in zip(list(out)[1:], rest):
        assert torch.equal(y, ref_y), key
        assert all(torch.equal(a, b) for a, b in zip(kv, ref_kv)), key


@pytest.mark.parametrize("kind, lens", [
    ("llama", [40]),  # one row
    ("llama", [700]),  # a context cut into attention parts, merged after every rank's share
    ("qwen2", [5, 17, 530, 64, 1]),  # qkv bias; rows of several lengths, one in parts
    ("qwen3", [33, 3, 90]),  # q/k norm
])
def test_a_team_step_is_the_one_thread_step_bit_for_bit(tmp_path, kernel_isa, team_ext, kind, lens):
    from engine.kv_cache import KVCacheSpec, allocate_kv_cache
    from engine.model import LlamaModel
    from engine.weights import load_checkpoint
    from tests.engine.factories import save_tiny_model

    save_tiny_model(tmp_path, kind)
    cfg, weights = load_checkpoint(tmp_path, torch.bfloat16)
    model = LlamaModel(cfg, weights, torch.bfloat16, max_positions=1024, kernel_isa=kernel_isa)
    assert model.fused is not None
    kv = allocate_kv_cache(KVCacheSpec.for_model(cfg, 16, "bfloat16"), len(lens) * (max(lens) // 16 + 1) + 1)
    _assert_all_equal(_steps(model, kv, lens, team_ext(kernel_isa)))


@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_a_quantized_team_step_is_the_one_thread_step_bit_for_bit(default_model_dir, quant_isa, team_ext,
                                                                  quantization):
    """The default model, its own Q4_1/Q8_0 blocks (gguf) or int8: the team splits the quantized
    matmuls by blocks of 32 columns as it does bf16's."""
    from engine.kv_cache import KVCacheSpec, allocate_kv_cache
    from engine.model import LlamaModel
    from engine.weights import load_checkpoint

    cfg, weights = load_checkpoint(default_model_dir, torch.float32, quantization=quantization)
    model = LlamaModel(cfg, weights, torch.float32, max_positions=512, kernel_isa=quant_isa,
                       quantization=quantization)
    kv = allocate_kv_cache(KVCacheSpec.for_model(cfg, 16, "float32"), 3 * 9 + 1)
    _assert_all_equal(_steps(model, kv, [1, 130, 33], team_ext(quant_isa)))


def test_the_default_model_decodes_the_same_tokens_with_and_without_the_team(default_model_dir, kernel_isa,
                                                                              team_ext):
    """What a user sees: the same greedy text, at 2 threads, either way."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    ext = team_ext(kernel_isa)
    llm = LLM(str(default_model_dir), kernel_isa=kernel_isa, num_kv_blocks=64)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = {}
        for setting in SETTINGS[:3]:
            ext.set_decode_team(*setting)
            outs[setting] = [o.token_ids for o in llm.generate(["The capital of France is", "1, 2, 3,"], params)]
    finally:
        torch.set_num_threads(threads)
    assert len(set(map(str, outs.values()))) == 1, outs
    assert llm.core.pool.is_fully_free()


@pytest.mark.parametrize("fetch", [-64, 100, (1 << 20) + 64])
def test_a_bad_team_setting_is_refused_by_name(kernel_isa, team_ext, fetch):
    ext = team_ext(kernel_isa)
    before = ext.decode_team()
    with pytest.raises(RuntimeError, match=f"set_decode_team: fetch_bytes must be a multiple of 64 .* not {fetch}"):
        ext.set_decode_team(True, fetch)
    assert ext.decode_team() == before


def test_the_team_bench_writes_every_setting_with_its_ratio(tmp_path, monkeypatch, kernel_isa):
    """engine.decode_team_bench on a tiny model, 2 rounds: a row per weight format and setting, the
    joins first at 1.00x; the module's setting put back; bad arguments refused by name."""
    from engine import benchmarks_md, decode_team_bench
    from tests.engine.factories import save_tiny_model

    save_tiny_model(tmp_path / "m", "llama")
    md = tmp_path / "BENCHMARKS.md"
    write = benchmarks_md.write_section
    monkeypatch.setattr(benchmarks_md, "write_section", lambda text: write(text, md))
    before = load_native_ops(kernel_isa).decode_team()
    assert decode_team_bench.main(["--model", str(tmp_path / "m"), "--isa", kernel_isa, "--rounds", "2",
                                   "--prompt-len", "16", "--new-tokens", "8", "--quantization", "none,int8",
                                   "--fetch", "0,4096", "--write"]) == 0
    text = md.read_text()
    assert text.count(decode_team_bench.SECTION) == 1 and "Same bits under every setting" in text
    every = decode_team_bench.settings(before[1], (0, 4096))
    assert [s[1] for s in every] == [False, True, True, True] and len({s[0] for s in every}) == 4
    for quant in ("none", "int8"):
        for s in every:
            row = re.search(rf"^\| {quant} \| {kernel_isa} \| 2 \| {re.escape(s[0])} \| ([\d.]+) \| ([\d.]+)x \| "
                            rf"([\d.]+) \| \d+% \| ([\d.]+), ([\d.]+) \| \*\*([\d.]+)x\*\* \|$", text, re.M)
            assert row and all(float(g) > 0 for g in row.groups()), (quant, s, text)
            if s == every[0]:
                assert row.groups()[3:] == ("1.00", "1.00", "1.00")
    assert load_native_ops(kernel_isa).decode_team() == before
    with pytest.raises(SystemExit, match="--fetch 100: must be a multiple of 64"):
        decode_team_bench.main(["--model", str(tmp_path / "m"), "--isa", kernel_isa, "--fetch", "100"])
    with pytest.raises(SystemExit, match="--threads 1,2: a team needs 2 threads or more"):
        decode_team_bench.main(["--model", str(tmp_path / "m"), "--isa", kernel_isa, "--threads", "1,2"])
