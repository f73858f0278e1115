"""The prefill and decode stages in one process over the `local` transport:
a disaggregated request equals the offline engine's, whether its ticket
comes before the prompt is computed or after, and aborts at any point leave
both pools free."""
from __future__ import annotations

import time

import pytest

from decode.stage import DecodeStage
from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from kvtransfer.config import ReceiverConfig, SenderConfig
from prefill.stage import PrefillStage
from tests.engine.factories import random_prompts, save_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny_model(d, "llama")
    return d


@pytest.fixture
def stages(model_dir):
    cfg = EngineConfig(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
    decode = DecodeStage("decode-0", str(model_dir), cfg, ReceiverConfig("s", "local", lease_s=10))
    prefill = PrefillStage("prefill-0", str(model_dir), cfg, SenderConfig("s", lease_s=10, deadline_s=10))
    yield prefill, decode
    prefill.close()
    decode.close()


def _collect(decode, rid):
    ids, finish = [], None
    for batch in decode.stream(rid, timeout_s=30):
        for d in batch:
            ids.extend(d.token_ids)
            finish = d.finish_reason or finish
    return ids, finish


def _wait_free(*stages_, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(s.is_fully_free() for s in stages_):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("ticket_first", [True, False], ids=["ticket-first", "ticket-after-prefill"])
def test_disaggregated_request_equals_engine(model_dir, stages, ticket_first):
    from concurrent.futures import ThreadPoolExecutor

    prefill, decode = stages
    prompts = random_prompts(3, 96, [5, 40, 17], seed=3)
    ref = LLM(str(model_dir), dtype="float32", num_kv_blocks=64).generate(prompts, GREEDY)
    with ThreadPoolExecutor(3) as pool:
        for i, p in enumerate(prompts):
            rid = f"r{i}-{ticket_first}"
            if ticket_first:
                ticket = decode.reserve(rid, p, GREEDY)
                fut = pool.submit(prefill.prefill, rid, p, GREEDY, ticket)
            else:
                fut = pool.submit(prefill.prefill, rid, p, GREEDY, None)
                time.sleep(0.3)  # the prompt is computed before the ticket exists
                prefill.attach_ticket(rid, decode.reserve(rid, p, GREEDY))
            ids, finish = _collect(decode, rid)
            assert fut.result(timeout=30).status == "DONE"
            assert ids == ref[i].token_ids and finish == "length"
    assert _wait_free(prefill, decode)


def test_a_ticket_that_comes_mid_forward_starts_the_transfer_between_layers(model_dir, stages):
    """The caller starts the prompt before the decode replica's ticket exists;
    the ticket lands as the forward pass begins. Its KV must go layer by layer
    from inside that pass, not all at once after it."""
    prefill, decode = stages
    p = random_prompts(1, 96, [40], seed=8)[0]
    ref = LLM(str(model_dir), dtype="float32", num_kv_blocks=64).generate([p], GREEDY)[0]
    ticket = decode.reserve("mid", p, GREEDY)
    inside, pushes = [False], []
    push_layer, on_batch = prefill.sender.push_layer, prefill._on_batch

    def recording_push(rid, layer):
        pushes.append((layer, inside[0]))
        return push_layer(rid, layer)

    def late_ticket(sched):
        hook = on_batch(sched)

        def wrapped(layer):
            if layer == 0:  # the ticket arrives as the pass has begun
                prefill.attach_ticket("mid", ticket)
            inside[0] = True
            try:
                if hook is not None:
                    hook(layer)
            finally:
                inside[0] = False
        return wrapped

    prefill.sender.push_layer, prefill._on_batch = recording_push, late_ticket
    assert prefill.late_ticket_overlap is False  # the default on CPU, where it costs TTFT
    prefill.late_ticket_overlap = True  # the default on CUDA
    assert prefill.prefill("mid", p, GREEDY, None, timeout_s=30).status == "DONE"
    ids, finish = _collect(decode, "mid")
    assert ids == ref.token_ids and finish == "length"
    num_layers = len(prefill.core.kv_caches)
    assert sorted(layer for layer, _ in pushes) == list(range(num_layers))
    assert all(during for _, during in pushes), pushes  # every layer went from inside the pass
    assert _wait_free(prefill, decode)


def test_abort_while_waiting_for_the_ticket_frees_the_prompt(stages):
    from concurrent.futures import ThreadPoolExecutor

    prefill, decode = stages
    p = random_prompts(1, 96, [40], seed=4)[0]
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(prefill.prefill, "gone", p, GREEDY, None)
        time.sleep(0.3)  # computed, holding its blocks, no ticket
        assert not prefill.is_fully_free()
        prefill.abort("gone")
        result = fut.result(timeout=30)
    assert result.status == "FAILED" and "abort" in result.error
    assert _wait_free(prefill, decode)


def test_decode_abort_before_the_kv_lands_frees_the_reservation(stages):
    prefill, decode = stages
    p = random_prompts(1, 96, [30], seed=5)[0]
    decode.reserve("r", p, GREEDY)
    assert not decode.is_fully_free()
    decode.abort("r")
    ids, finish = _collect(decode, "r")
    assert finish == "abort" and ids == []
    assert _wait_free(prefill, decode)


def test_prefill_stream_sends_the_first_token_with_its_logprobs_before_the_result(stages):
    from prefill.stage import FirstToken, PrefillResult

    prefill, decode = stages
    p = random_prompts(1, 96, [30], seed=6)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    events = prefill.prefill_stream("lp", p, params, None)
    first = next(events)  # computed before any ticket exists: it does not wait for the transfer
    assert isinstance(first, FirstToken) and first.logprobs is not None
    assert len(first.logprobs["top"]) == 2 and first.logprobs["top"][0][0] == first.token_id
    prefill.attach_ticket("lp", decode.reserve("lp", p, params))
    result = next(events)
    assert isinstance(result, PrefillResult) and result.status == "DONE" and result.first_token == first.token_id
    ids, _ = _collect(decode, "lp")
    assert ids[0] == first.token_id and len(ids) == 4
    assert _wait_free(prefill, decode)


def test_decode_abort_as_the_kv_lands_frees_the_blocks(stages):
    """The abort reaches the decode loop after the transfer is DONE but before
    the loop polled it: no sequence waits for it, and the blocks are freed."""
    from concurrent.futures import ThreadPoolExecutor

    prefill, decode = stages
    p = random_prompts(1, 96, [30], seed=7)[0]
    ticket = decode.reserve("late", p, GREEDY)

    def abort_once_landed():  # on the decode loop thread, so no poll() runs in between
        deadline = time.monotonic() + 20
        while decode.receiver.core.ledger.for_request("late").state.name != "DONE":
            assert time.monotonic() < deadline, "the transfer never completed"
            time.sleep(0.001)
        decode._abort("late")

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(prefill.prefill, "late", p, GREEDY, ticket)
        decode.call(abort_once_landed, timeout=30)
        assert fut.result(timeout=30).status == "DONE"
    ids, finish = _collect(decode, "late")
    assert finish == "abort"
    assert _wait_free(prefill, decode)
