"""Pipeline parallelism: greedy fp32 output at PP=N (and PP x TP) equals PP=1's and
transformers', token for token; micro-batched decode and pipelined prefill chunks change
nothing; a dead or stuck pipeline rank fails the call in bounded time and leaves nothing
behind; a split that does not fit the model is refused before any rank starts."""
from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch

from engine.config import ConfigError
from engine.llm import LLM
from engine.parallel.comm import CollectiveError
from engine.parallel.shm import SEGMENT_PREFIX
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from tests.engine.factories import hf_greedy_mismatch, random_prompts, save_tiny_model
from tests.engine.test_tp_lifecycle import segments, spawned_children, wait_gone

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

# name: (kind, checkpoint overrides, pp, pipeline_layer_split, tp, engine overrides). TINY: 4 heads, 2 KV heads.
CASES = {
    "llama-pp2": ("llama", {"num_hidden_layers": 4}, 2, None, 1, {}),
    "llama-pp2-split-1-3": ("llama", {"num_hidden_layers": 4}, 2, [1, 3], 1, {}),
    # three stages of 2, 1, 1 layers; chunked prefill beside decodes, and a cache small enough to preempt
    "llama-pp3-preempt": ("llama", {"num_hidden_layers": 4}, 3, None, 1,
                          {"num_kv_blocks": 7, "max_num_batched_tokens": 32}),
    "llama-pp2-tied": ("llama", {"num_hidden_layers": 3, "tie_word_embeddings": True}, 2, [2, 1], 1, {}),
    "qwen2-qkv-bias-pp2-split-3-1": ("qwen2", {"num_hidden_layers": 4}, 2, [3, 1], 1, {}),
    "qwen3-qk-norm-pp3": ("qwen3", {"num_hidden_layers": 3}, 3, None, 1, {}),
    "qwen3_moe-pp2": ("qwen3_moe", {}, 2, None, 1, {}),  # layer 0 sparse on stage 0, layer 1 dense on stage 1
    "mixtral-pp2": ("mixtral", {}, 2, None, 1, {}),
    "olmoe-pp2-tp2": ("olmoe", {}, 2, None, 2, {}),  # the full-width q/k norm's all-reduce inside each stage
    "llama-pp2-tp2": ("llama", {"num_hidden_layers": 4}, 2, [1, 3], 2, {}),
    # the hand-offs over gloo point-to-point (engine.parallel.pipe.DistLinks), the stages' all-reduces
    # within each stage's gloo group
    "llama-pp2-gloo": ("llama", {"num_hidden_layers": 4}, 2, None, 1, {"tp_backend": "gloo"}),
    "llama-pp3-split-1-3-1-gloo": ("llama", {"num_hidden_layers": 5}, 3, [1, 3, 1], 1, {"tp_backend": "gloo"}),
    "qwen2-pp2-tp2-split-3-1-gloo": ("qwen2", {"num_hidden_layers": 4}, 2, [3, 1], 2, {"tp_backend": "gloo"}),
    "qwen3_moe-pp2-gloo": ("qwen3_moe", {}, 2, None, 1, {"tp_backend": "gloo"}),
    # expert parallelism inside each stage, the tokens dispatched by all-to-all within the stage's group
    "mixtral-pp2-ep2-alltoall": ("mixtral", {}, 2, None, 2, {"enable_expert_parallel": True,
                                                             "moe_dispatch": "alltoall"}),
    "mixtral-pp2-ep2-alltoall-gloo": ("mixtral", {}, 2, None, 2, {"enable_expert_parallel": True,
                                                                  "moe_dispatch": "alltoall", "tp_backend": "gloo"}),
}
# (engine fields the PP=1, TP=1 reference runs without)
PARALLEL_ONLY = ("enable_expert_parallel", "moe_dispatch")


def own_segments() -> set[str]:
    """This process's segments (and their KV cache files): other test runs may share /dev/shm."""
    return {n for n in segments() if n.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-")}


@pytest.fixture(autouse=True)
def no_leaks():
    before = own_segments()
    yield
    gc.collect()
    assert wait_gone(spawned_children()), "a pipeline rank outlived its test"
    assert own_segments() <= before, "a shared-memory segment outlived its test"


def generate(folder, prompts, params=GREEDY, **kw) -> list[list[int]]:
    kw = {"dtype": "float32", "num_kv_blocks": 64, "max_num_batched_tokens": 64, **kw}
    with LLM(str(folder), **kw) as llm:
        outs = llm.generate(prompts, params)
        assert llm.core.is_idle()
        if llm.core.tp_group is not None:
            assert len(llm.core.tp_group.pids) == llm.core.tp_group.size - 1
        return [o.token_ids for o in outs]


@pytest.mark.parametrize("name", sorted(CASES))
def test_pp_greedy_equals_pp1_and_transformers(tmp_path, name):
    from transformers import AutoModelForCausalLM

    kind, over, pp, split, tp, engine_kw = CASES[name]
    save_tiny_model(tmp_path, kind, **over)
    prompts = random_prompts(4, 96, [5, 23, 40, 1], seed=1)
    ref = generate(tmp_path, prompts, **{k: v for k, v in engine_kw.items() if k not in PARALLEL_ONLY})
    out = generate(tmp_path, prompts, pipeline_parallel_size=pp, pipeline_layer_split=split,
                   tensor_parallel_size=tp, **engine_kw)
    assert out == ref, f"{name}: PP={pp} x TP={tp} diverged from PP=1"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for p, o in zip(prompts, out):
        assert hf_greedy_mismatch(hf, p, o) is None, f"{name}: PP={pp} diverged from transformers"


def test_bf16_stages_decode_fused_and_equal_pp1(tmp_path):
    """bf16: each stage runs its decode layers in one native call (FusedDecoder takes the previous
    stage's hidden states; one before the last returns its residual stream), with the same
    roundings as the whole stack at PP=1, so the tokens are the same."""
    save_tiny_model(tmp_path, "llama", num_hidden_layers=4, initializer_range=0.2)
    prompts = random_prompts(6, 96, [7, 30, 2], seed=2)
    ref = generate(tmp_path, prompts, dtype="bfloat16")
    with LLM(str(tmp_path), dtype="bfloat16", num_kv_blocks=64, pipeline_parallel_size=2,
             pipeline_layer_split=[3, 1]) as llm:
        if llm.core.model.ops.packs_weights:  # (a CPU with the native kernels)
            assert llm.core.model.fused is not None
        out = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.core.is_idle()
    assert out == ref


def test_each_rank_holds_only_its_layers(tmp_path):
    """PP=2 x TP=2 with layers [1, 3]: rank r = pp_rank * 2 + tp_rank; each rank's weights and KV
    cache cover its stage's layers and its KV head; the embedding on stage 0, the LM head on stage 1."""
    save_tiny_model(tmp_path, "llama", num_hidden_layers=4)
    with LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, pipeline_parallel_size=2,
             pipeline_layer_split=[1, 3], tensor_parallel_size=2) as llm:
        group = llm.core.tp_group
        assert group.rank_layers() == [range(0, 1), range(0, 1), range(1, 4), range(1, 4)]
        caches = group.rank_kv_caches()
        assert [len(c) for c in caches] == [1, 1, 3, 3]
        assert all(t.shape[3] == 1 for c in caches for t in c)  # one KV head a rank
        model = llm.core.model
        assert len(model.layers) == 1 and model.lm_head is None and model.norm is None
        assert model.embed is not None
        stage1 = group.rank_memory[2].weight_bytes
        assert stage1 > 2 * group.rank_memory[1].weight_bytes  # three layers and the LM head against one layer
        [out] = llm.generate([[5, 6, 7, 8]], GREEDY)
        assert len(out.token_ids) == 16


def test_over_gloo_the_hand_offs_go_rank_to_rank_not_through_the_segment(tmp_path):
    """tp_backend gloo: the segment holds no hand-off slots (the payloads cannot pass through it,
    and it is that much smaller), and what rank 0 sent stage 1 is the residual stream, fp32."""
    save_tiny_model(tmp_path, "llama", num_hidden_layers=4)
    prompts = random_prompts(3, 96, [5, 23], seed=8)
    ref = generate(tmp_path, prompts)
    with LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, pipeline_parallel_size=2,
             tp_backend="gloo") as llm:
        group = llm.core.tp_group
        assert group.layout.act_bytes == group.layout.ret_bytes == 0
        assert group.pipe.links is not None and group.pipe.links.backend == "gloo"
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
        stats = group.pipe.stats
        assert stats.tokens_sent == sum(len(p) for p in prompts) + len(prompts) * (GREEDY.max_tokens - 1)
        assert stats.bytes_sent == stats.tokens_sent * llm.core.model_config.hidden_size * 4


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_micro_batched_decode_of_16_requests_equals_pp1(tmp_path, monkeypatch, backend):
    """16 concurrent requests at PP=2: two batches of 8 are in the pipeline at once, no sequence
    in both, and every token is PP=1's (gloo: the hand-offs rank to rank, two batches' sends
    outstanding on a link)."""
    save_tiny_model(tmp_path, "llama", num_hidden_layers=4)
    prompts = random_prompts(16, 96, [3, 9, 17, 30], seed=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = generate(tmp_path, prompts, params, num_kv_blocks=128)
    from engine.parallel.runner import PPRunner

    events = []  # ("launch", sampling ids) / ("collect", sampling ids), in order
    launch, collect = PPRunner.launch, PPRunner.collect

    def logged_launch(self, batch, hook=None):
        events.append(("launch", [s.seq.request_id for s in batch if s.samples]))
        return launch(self, batch, hook)

    def logged_collect(self, batch):
        events.append(("collect", [s.seq.request_id for s in batch.samplers]))
        return collect(self, batch)

    monkeypatch.setattr(PPRunner, "launch", logged_launch)
    monkeypatch.setattr(PPRunner, "collect", logged_collect)
    out = generate(tmp_path, prompts, params, num_kv_blocks=128, pipeline_parallel_size=2, tp_backend=backend)
    assert out == ref
    in_flight: list[list[str]] = []
    overlapped = 0
    for kind, ids in events:
        if kind == "collect":
            assert in_flight.pop(0) == ids  # in launch order
            continue
        busy = {i for b in in_flight for i in b}
        assert not busy & set(ids), "a sequence in two in-flight batches"
        overlapped += bool(in_flight)
        in_flight.append(ids)
        assert len(in_flight) <= 2 and len(ids) <= 8
    launches = sum(kind == "launch" for kind, _ in events)
    assert overlapped > 0.9 * launches  # the next batch starts while the last is on stage 1


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_every_sampling_mode_equals_pp1_and_plain_greedy_returns_tokens_only(tmp_path, monkeypatch, backend):
    """The last stage takes the argmax itself (and returns 4 bytes a row instead of the logits)
    only for a batch whose every sampler is plain greedy; seeded sampling, logprobs, penalties and
    logit_bias beside greedy rows still get the logits on rank 0: every token and logprob is PP=1's."""
    save_tiny_model(tmp_path, "llama", num_hidden_layers=4)
    prompts = random_prompts(8, 96, [4, 11, 25], seed=6)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    modes = [greedy] * 4 + [  # (a micro-batch takes half of the sequences, in order)
        SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, top_k=5, seed=3, logit_bias={5: 4.0}, ignore_eos=True),
    ]

    def run(**kw):
        with LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, **kw) as llm:
            outs = llm.generate(prompts, modes)
            assert llm.core.is_idle()  # every block back in the pool
            return [(o.token_ids, o.logprobs) for o in outs]

    ref = run()
    from engine.parallel.runner import PPRunner

    def same(a, b):  # tokens exactly; logprobs to fp32 rounding (the LM head sees 8 rows at PP=1, 4 here)
        for (ta, la), (tb, lb) in zip(a, b):
            assert ta == tb
            assert (la is None) == (lb is None)
            for x, y in zip(la or [], lb or []):
                assert x["token_logprob"] == pytest.approx(y["token_logprob"], abs=1e-5)
                assert [t for t, _ in x["top"]] == [t for t, _ in y["top"]]
        return len(a) == len(b)

    kinds = []  # per collected batch with samplers: whether it came back as tokens
    collect = PPRunner.collect

    def logged_collect(self, batch):
        if batch.samplers:
            kinds.append(batch.argmax)
        return collect(self, batch)

    monkeypatch.setattr(PPRunner, "collect", logged_collect)
    assert same(run(pipeline_parallel_size=2, tp_backend=backend), ref)
    assert True in kinds and False in kinds  # both ways back were taken
    # greedy alone: every batch comes back as tokens
    kinds.clear()
    assert generate(tmp_path, prompts, greedy, pipeline_parallel_size=2, tp_backend=backend) == \
        generate(tmp_path, prompts, greedy)
    assert kinds and all(kinds)


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_pipelined_long_prompt_equals_unchunked(tmp_path, backend):
    """One 200-token prompt in chunks of 16 at PP=2: consecutive chunks are in the pipeline
    together (chunk k+1 on stage 0 while chunk k is on stage 1), and the output is that of
    the prompt in one chunk at PP=1."""
    save_tiny_model(tmp_path, "llama", num_hidden_layers=4, max_position_embeddings=512)
    prompt = random_prompts(1, 96, [200], seed=4)[0]
    ref = generate(tmp_path, [prompt], max_num_batched_tokens=256)
    with LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
             pipeline_parallel_size=2, tp_backend=backend) as llm:
        core = llm.core
        chunks_in_flight, collect = [], core.runner.collect

        def logged_collect(batch):  # the batch coming back, and those behind it
            chunks_in_flight.append(1 + sum(len(b.sched.scheduled) for b in core._in_flight))
            return collect(batch)

        core.runner.collect = logged_collect
        core.add(Sequence("long", list(prompt), GREEDY))
        out = None
        while core.has_unfinished():
            for o in core.step():
                out = o.seq
        assert len(chunks_in_flight) == 13 + 15  # 200 / 16 chunks, then a decode step per token after the first
        assert chunks_in_flight[:12] == [2] * 12  # chunk k+1 was launched before chunk k came back
        assert llm.core.is_idle()
    assert out.output_token_ids == ref[0]


def test_layer_hook_gets_global_layer_ids_as_each_stage_finishes(tmp_path):
    """The hook (where a prefill stage starts its KV sends) sees every global layer once per
    batch, in order: rank 0's own during its forward, each later stage's when that stage is done."""
    save_tiny_model(tmp_path, "llama", num_hidden_layers=5)
    with LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, pipeline_parallel_size=3,
             pipeline_layer_split=[2, 1, 2]) as llm:
        calls: list[list[int]] = []

        def on_batch(sched):
            calls.append([])
            return calls[-1].append

        llm.core.add(Sequence("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)))
        while llm.core.has_unfinished():
            llm.core.step(on_batch)
    assert len(calls) == 3
    assert all(c == [0, 1, 2, 3, 4] for c in calls)


@pytest.mark.parametrize("backend", ["shm", "gloo"])
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_dead_or_stuck_pipeline_rank_fails_the_call_in_bounded_time(tmp_path, how, backend):
    """SIGKILL of the middle stage's rank mid-prefill: rank 0 sees it gone and the error names it;
    SIGSTOP: the wait for its hand-off times out. No process and no segment is left (gloo: no
    rank is left in a receive or a send to the dead one)."""
    save_tiny_model(tmp_path, "llama", num_hidden_layers=3, max_position_embeddings=512)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
              pipeline_parallel_size=3, tp_timeout_s=2.0, tp_backend=backend)
    pids = llm.core.tp_group.pids
    llm.core.add(Sequence("long", random_prompts(1, 96, [300], seed=5)[0], GREEDY))
    batches = []

    def on_batch(sched):
        batches.append(sched)
        if len(batches) == 4:  # the prompt's 4th chunk of 19
            os.kill(pids[0], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        return None

    t0 = time.monotonic()
    named = r"rank 1 \(pid \d+\) is gone" if how == "kill" else r"stage 1 \(rank 1\).*timeout"
    if how == "kill" and backend == "gloo":  # or rank 2 was receiving from it: its connection broke first
        named += r"|from stage 1 \(rank 1\) \(gloo\) failed on rank 2: .*Connection reset"
    with pytest.raises(CollectiveError, match=named):
        while llm.core.has_unfinished():
            llm.core.step(on_batch)
    assert time.monotonic() - t0 < 8.0
    assert len(batches) < 19  # it failed mid-prefill
    assert wait_gone(pids, 10.0)  # the others stop at the abort; a stopped one is killed by the teardown
    llm.close()


def test_close_and_garbage_collection_leave_no_rank_and_no_segment(tmp_path):
    save_tiny_model(tmp_path, "llama", num_hidden_layers=3)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, pipeline_parallel_size=3)
    pids = llm.core.tp_group.pids
    assert len(pids) == 2 and own_segments() == set()  # (unlinked once every rank mapped it)
    llm.generate([[5, 6, 7]], GREEDY)
    del llm
    gc.collect()
    assert wait_gone(pids, 10.0)


@pytest.mark.parametrize("kw,message", [
    (dict(pipeline_parallel_size=2, pipeline_layer_split=[1, 2]),
     r"pipeline_layer_split: \[1, 2\] sums to 3 layers; the model has 4"),
    (dict(pipeline_parallel_size=5), "pipeline_parallel_size: 5 stages for a model of 4 layers"),
    (dict(pipeline_parallel_size=2, pipeline_layer_split=[4]), "1 counts for pipeline_parallel_size 2"),
    (dict(pipeline_parallel_size=2, tp_backend="nccl"), "tp_backend: nccl needs device: cuda"),
])
def test_a_bad_split_is_refused_before_any_rank_starts(tmp_path, kw, message):
    save_tiny_model(tmp_path, "llama", num_hidden_layers=4)
    with pytest.raises(ConfigError, match=message):
        LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, **kw)
    assert not spawned_children()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_expert_load_counts_every_stages_layers(tmp_path, kind):
    """A mixture of experts at PP=2: the per-layer, per-expert token counts rank 0 reports
    (EngineCore.expert_load, the replica metric's source) are PP=1's, later stages' layers included."""
    save_tiny_model(tmp_path, kind, num_hidden_layers=4)
    prompts = random_prompts(6, 96, [9, 30], seed=8)

    def load(**kw):
        with LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, **kw) as llm:
            llm.generate(prompts, GREEDY)
            assert llm.core.is_idle()  # every block back in the pool
            return llm.core.expert_load()

    ref, got = load(), load(pipeline_parallel_size=2)
    assert ref.shape == got.shape and ref.shape[0] >= 2
    assert int(got[-1].sum()) > 0  # the last stage's sparse layer is counted, not zeros
    assert torch.equal(got, ref)


@pytest.mark.slow
def test_default_model_pp2_equals_pp1(default_model_dir):
    """SmolLM2-135M's 30 layers in two stages of 15."""
    prompts = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    with LLM(str(default_model_dir), dtype="float32", num_kv_blocks=32) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    with LLM(str(default_model_dir), dtype="float32", num_kv_blocks=32, pipeline_parallel_size=2) as llm:
        assert llm.core.tp_group.rank_layers() == [range(0, 15), range(15, 30)]
        assert llm.core.kv_spec.num_layers == 15
        out = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.core.is_idle()
    assert out == ref
