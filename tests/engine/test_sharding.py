"""The tensor-parallel plan and the per-step message, in one process (no ranks started)."""
from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.parallel.sharding import ShardLayout, check_tensor_parallel, load_shard, pipeline_layers, weight_shards
from engine.parallel.step import StepDecoder, StepEncoder
from engine.runner import ModelRunner, plan_scores
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence, SequenceStatus
from tests.engine.factories import save_tiny_model


def model_config(heads: int, kv_heads: int, vocab: int = 96, inter: int = 72) -> ModelConfig:
    return ModelConfig("llama", vocab, 8 * heads, inter, 2, heads, kv_heads, 8)


@pytest.mark.parametrize("heads,kv_heads,tp", [(4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 2, 4), (8, 4, 2),
                                               (9, 3, 3), (4, 4, 4), (8, 1, 8), (8, 2, 8)])
def test_every_query_head_reads_a_kv_head_its_rank_holds(heads, kv_heads, tp):
    cfg = model_config(heads, kv_heads)
    group = heads // kv_heads
    seen_q, seen_kv = [], set()
    for r in range(tp):
        s = ShardLayout.for_rank(cfg, r, tp)
        q = range(s.head_start, s.head_start + s.num_heads)
        kv = range(*s.kv_head_range)
        assert s.num_heads % s.num_kv_heads == 0
        for i, h in enumerate(q):  # local GQA: local query head i reads local KV head i // (nh / nkv)
            assert h // group == kv[i // (s.num_heads // s.num_kv_heads)]
        seen_q += q
        seen_kv |= set(kv)
    assert seen_q == list(range(heads))  # every query head exactly once
    assert seen_kv == set(range(kv_heads))  # every KV head somewhere (replicated when tp > kv_heads)


@pytest.mark.parametrize("heads,kv_heads,inter,tp,field", [
    (4, 2, 64, 3, "num_attention_heads"),
    (12, 4, 64, 6, "num_key_value_heads"),  # neither divides the other
    (4, 2, 66, 4, "intermediate_size"),
    (9, 3, 64, 3, "intermediate_size"),
])
def test_a_split_the_model_does_not_allow_is_refused_naming_the_field(heads, kv_heads, inter, tp, field):
    with pytest.raises(ConfigError, match=rf"tensor_parallel_size: {tp} .*{field}"):
        check_tensor_parallel(model_config(heads, kv_heads, inter=inter), tp)


@pytest.mark.parametrize("bad", [0, -1, "2", 1.5, True])
def test_engine_config_refuses_a_bad_tensor_parallel_size(bad):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=bad).validate()


def test_engine_config_refuses_a_bad_backend_and_timeout():
    with pytest.raises(ConfigError, match="tp_backend"):
        EngineConfig(tp_backend="nccl2").validate()
    with pytest.raises(ConfigError, match="tp_timeout_s"):
        EngineConfig(tp_timeout_s=0).validate()


@pytest.mark.parametrize("kind,over,tp", [
    ("llama", {}, 2), ("llama", {"vocab_size": 95, "tie_word_embeddings": True}, 4),
    ("qwen2", {}, 2), ("qwen3", {}, 4)])
def test_each_rank_reads_exactly_its_slice_and_the_slices_make_the_checkpoint(tmp_path, kind, over, tp):
    full = save_tiny_model(tmp_path, kind, **over)
    from engine.weights import read_config

    cfg = read_config(tmp_path)
    shards = []
    for r in range(tp):
        layout = ShardLayout.for_rank(cfg, r, tp)
        _, w = load_shard(tmp_path, layout)
        plan = weight_shards(cfg, layout)
        assert set(w) == {n for n in plan if n in full and not (n == "lm_head.weight" and cfg.tie_word_embeddings)}
        shards.append((layout, plan, w))
    for name, t in full.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # not in the files: the model looks up its embedding shard
        layout, plan, _ = shards[0]
        spec = plan[name]
        parts = [w[name] for _, _, w in shards]
        if spec.dim is None:
            assert all(torch.equal(p, t) for p in parts), name
            continue
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")) and tp > cfg.num_kv_heads:
            # replicated KV heads: rank r holds KV head r // (tp / num_kv_heads)
            per = tp // cfg.num_kv_heads
            parts = parts[::per]
        joined = torch.cat(parts, dim=spec.dim)
        assert torch.equal(joined.narrow(spec.dim, 0, t.shape[spec.dim]), t), name
        assert not joined.narrow(spec.dim, t.shape[spec.dim], joined.shape[spec.dim] - t.shape[spec.dim]).any()


def _seq(rid: str, prompt: list[int], blocks: list[int], prompt_logprobs: int | None = None) -> Sequence:
    s = Sequence(rid, prompt, SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs))
    s.block_ids = list(blocks)
    return s


def _prepared(runner: ModelRunner, batch) -> list:
    ids, pos, meta, rows = runner.prepare(batch)
    out = [ids, pos, meta.slot_blocks, meta.slot_offsets, meta.num_decode, meta.decode_block_tables,
           meta.decode_context_lens, meta.decode_mask, rows]
    out += [(p.query_start, p.num_queries, p.context_len, p.block_table) for p in meta.prefills]
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is not None and b is not None and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_step_message_rebuilds_the_same_batch_through_appends_preemption_and_reuse():
    """Every rank must build the same tensors as rank 0 from ids and block-table diffs."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.device = 4, torch.device("cpu")
    enc, dec = StepEncoder(), StepDecoder()

    def check(batch):
        scores = plan_scores(batch)
        payload = enc.encode(batch, scores)
        rows, got = dec.decode(payload)
        assert _same(_prepared(runner, batch), _prepared(runner, rows))
        # the prompt positions rank 0 scores: the same rows and targets on every rank
        assert (got.rows, got.targets, got.top) == (scores.rows, scores.targets, scores.top) if scores else got is None
        return len(payload)

    a = _seq("a", list(range(3, 12)), [7, 2, 9], prompt_logprobs=2)  # 9 prompt tokens, scored
    b = _seq("b", [5, 6], [4])
    check([ScheduledSeq(a, 6, 0), ScheduledSeq(b, 2, 0)])  # a chunked, b whole
    assert plan_scores([ScheduledSeq(a, 6, 0)]).targets == a.prompt_token_ids[1:7]
    b.output_token_ids += [40]
    check([ScheduledSeq(b, 1, 2), ScheduledSeq(a, 3, 6)])  # decodes first, then prefill chunks
    # a's last chunk scores positions 6 and 7 (token 8 is scored by none: it is the prompt's last),
    # on rows 1 and 2, after b's decode row
    assert plan_scores([ScheduledSeq(b, 1, 2), ScheduledSeq(a, 3, 6)]).rows == [1, 2]
    a.output_token_ids += [50]
    b.output_token_ids += [41]
    a.block_ids.append(11)  # a grows a block: the message carries only the new id
    size_append = check([ScheduledSeq(a, 1, 9), ScheduledSeq(b, 1, 3)])
    a.output_token_ids += [51]
    size_steady = check([ScheduledSeq(a, 1, 10)])
    assert size_steady < size_append
    b.block_ids = []  # b preempted: its blocks freed, the ranks drop it
    check([ScheduledSeq(a, 1, 10)])
    assert len(dec.blocks) == 1
    b.block_ids = [8, 3]  # recomputed from scratch on other blocks
    check([ScheduledSeq(b, 4, 0), ScheduledSeq(a, 1, 10)])
    b.block_ids = [3, 8]  # a table that does not extend the mirrored one is sent whole
    check([ScheduledSeq(b, 4, 0)])
    a.status = SequenceStatus.FINISHED_STOPPED
    c = _seq("c", [9, 9, 9, 9, 9], [1, 5])  # takes a's slot
    b.output_token_ids += [42]
    check([ScheduledSeq(c, 5, 0), ScheduledSeq(b, 1, 4)])
    assert len(dec.blocks) == 2
    a2 = _seq("a", [1, 2], [6])  # the same request id again, a new sequence
    c.output_token_ids += [60]
    check([ScheduledSeq(a2, 2, 0), ScheduledSeq(c, 1, 5)])
    assert dec.blocks == {s: list(q.block_ids) for s, (q, _) in enc._mirror.items()}


def test_pipeline_layers_even_uneven_and_explicit():
    assert pipeline_layers(7, 1) == (range(0, 7),)
    assert pipeline_layers(7, 3) == (range(0, 3), range(3, 5), range(5, 7))
    assert pipeline_layers(6, 2, [1, 5]) == (range(0, 1), range(1, 6))


@pytest.mark.parametrize("num_layers,pp,split,message", [
    (4, 2, [1, 2], "sums to 3 layers; the model has 4"),
    (4, 2, [4], "1 counts for pipeline_parallel_size 2"),
    (2, 3, None, "3 stages for a model of 2 layers"),
])
def test_pipeline_layers_refuse_a_split_that_does_not_fit(num_layers, pp, split, message):
    with pytest.raises(ConfigError, match="pipeline_") as e:
        pipeline_layers(num_layers, pp, split)
    assert message in str(e.value)


@pytest.mark.parametrize("kwargs,message", [
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size: must be an integer >= 1"),
    (dict(pipeline_parallel_size=2, pipeline_layer_split=(1, 2, 3)), "3 counts for pipeline_parallel_size 2"),
    (dict(pipeline_layer_split=(0,)), "layer counts >= 1"),
])
def test_engine_config_names_a_bad_pipeline_setting(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs).validate()
