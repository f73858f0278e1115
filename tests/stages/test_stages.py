"""The prefill and decode stages in one process over the `local` transport,
driven through their frame handlers (`tests.stages.harness`): a
disaggregated request equals the offline engine's, whether its ticket comes
before the prompt is computed or after; each token comes once, from one
replica; aborts at any point leave both pools free."""
from __future__ import annotations

import time

import pytest

from decode.stage import DecodeStage
from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.guided import GuidedSpec
from engine.serving.frames import (Abort, Attach, FirstToken, Prefill, PrefillDone, PrefillLost, Refused, Reserve,
                                   Submit, TicketReady)
from engine.serving.types import FinishReason
from kvtransfer.config import ReceiverConfig, SenderConfig
from prefill.stage import PrefillStage
from tests.engine.factories import random_prompts, save_tiny_model_with_tokenizer
from tests.stages.harness import Driver, disaggregated, wait_free

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny_model_with_tokenizer(d, default_model_dir)  # outputs have text
    return d


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=64)


@pytest.fixture
def stages(model_dir):
    cfg = EngineConfig(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
    decode = DecodeStage("decode-0", str(model_dir), cfg, ReceiverConfig("s", "local", lease_s=10))
    prefill = PrefillStage("prefill-0", str(model_dir), cfg, SenderConfig("s", lease_s=10, deadline_s=10))
    yield Driver(prefill), Driver(decode)
    prefill.close()
    decode.close()


def _ids(first, deltas) -> list[int]:
    return first.delta.token_ids + [t for d in deltas for t in d.token_ids]


@pytest.mark.parametrize("ticket_first", [True, False], ids=["ticket-first", "ticket-after-prefill"])
def test_disaggregated_request_equals_engine(reference, stages, ticket_first):
    prefill, decode = stages
    prompts = random_prompts(3, 96, [5, 40, 17], seed=3)
    ref = reference.generate(prompts, GREEDY)
    for i, p in enumerate(prompts):
        first, deltas, done = disaggregated(prefill, decode, f"r{i}", p, GREEDY, ticket_first)
        assert done.ok, done.error
        assert _ids(first, deltas) == ref[i].token_ids and deltas[-1].finish_reason == "length"
        # one path per token: the decode replica streams from the second token on
        assert [t for d in deltas for t in d.token_ids] == ref[i].token_ids[1:]
    assert wait_free(prefill.stage, decode.stage)


def test_the_text_across_the_seam_and_a_first_token_that_ends_the_request(model_dir, reference, stages):
    """The client's text is the engine's, though its first token's text was
    made on another replica; a request that its first token ends (max_tokens,
    a stop token, a stop string) gets its last delta, without the token again,
    from the decode replica."""
    from engine.tokenizer import Tokenizer

    prefill, decode = stages
    p = random_prompts(1, 96, [20], seed=9)[0]
    ref = reference.generate([p], GREEDY)[0]
    first_id = ref.token_ids[0]
    cases = {
        "max-tokens": SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        "stop-token": SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[first_id]),
        "long": SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    }
    text = Tokenizer.from_folder(model_dir).decode([first_id])
    assert text.strip(), "the prompt's first output token has no text: pick another seed"
    cases["stop-string"] = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[text.strip()])
    for name, params in cases.items():
        want = reference.generate([p], params)[0]
        first, deltas, done = disaggregated(prefill, decode, name, p, params)
        assert done.ok
        assert _ids(first, deltas) == want.token_ids, name
        assert first.delta.text + "".join(d.text for d in deltas) == want.text, name
        assert deltas[-1].finish_reason == want.finish_reason, name
        assert want.text or name == "stop-string", name
        assert (want.finish_reason == "stop") == name.startswith("stop"), name
        if len(want.token_ids) == 1:
            assert [d.token_ids for d in deltas] == [[]], name  # the token came once, from prefill
    assert wait_free(prefill.stage, decode.stage)


def test_a_ticket_that_comes_mid_forward_starts_the_transfer_between_layers(reference, stages):
    """The frontend starts the prompt before the decode replica's ticket
    exists; the ticket lands as the forward pass begins. Its KV must go layer
    by layer from inside that pass, not all at once after it. (The layer
    hook is wrapped only to land the Attach at layer 0 and to see where each
    push happens.)"""
    prefill, decode = stages
    stage = prefill.stage
    p = random_prompts(1, 96, [40], seed=8)[0]
    ref = reference.generate([p], GREEDY)[0]
    decode.send(Reserve("mid", p, GREEDY))
    ticket = decode.next("mid")
    assert isinstance(ticket, TicketReady)
    inside, pushes = [False], []
    push_layer, on_batch = stage.sender.push_layer, stage._on_batch

    def recording_push(rid, layer):
        pushes.append((layer, inside[0]))
        return push_layer(rid, layer)

    def late_ticket(sched):
        hook = on_batch(sched)

        def wrapped(layer):
            if layer == 0:  # the ticket arrives as the pass has begun
                prefill.send(Attach("mid", ticket.ticket))
            inside[0] = True
            try:
                if hook is not None:
                    hook(layer)
            finally:
                inside[0] = False
        return wrapped

    stage.sender.push_layer, stage._on_batch = recording_push, late_ticket
    assert stage.late_ticket_overlap is False  # the default on CPU, where it costs TTFT
    stage.late_ticket_overlap = True  # the default on CUDA
    prefill.send(Prefill("mid", p, GREEDY))
    first = prefill.next("mid")
    done = prefill.next("mid")
    assert isinstance(first, FirstToken) and isinstance(done, PrefillDone) and done.ok
    deltas = decode.stream("mid")
    assert _ids(first, deltas) == ref.token_ids and deltas[-1].finish_reason == "length"
    num_layers = len(stage.core.kv_caches)
    assert sorted(layer for layer, _ in pushes) == list(range(num_layers))
    assert all(during for _, during in pushes), pushes  # every layer went from inside the pass
    assert wait_free(prefill.stage, decode.stage)


def test_abort_while_waiting_for_the_ticket_frees_the_prompt(stages):
    prefill, decode = stages
    p = random_prompts(1, 96, [40], seed=4)[0]
    prefill.send(Prefill("gone", p, GREEDY))
    assert isinstance(prefill.next("gone"), FirstToken)  # computed, holding its blocks, no ticket
    assert not prefill.stage.is_fully_free()
    prefill.send(Abort("gone"))
    done = prefill.next("gone")
    assert isinstance(done, PrefillDone) and not done.ok and "abort" in done.error
    assert wait_free(prefill.stage, decode.stage)


def test_decode_abort_before_the_kv_lands_frees_the_reservation(stages):
    prefill, decode = stages
    p = random_prompts(1, 96, [30], seed=5)[0]
    decode.send(Reserve("r", p, GREEDY))
    assert isinstance(decode.next("r"), TicketReady)
    assert not decode.stage.is_fully_free()
    decode.send(Abort("r"))
    deltas = decode.stream("r")
    assert [d.finish_reason for d in deltas] == [FinishReason.ABORT] and deltas[0].token_ids == []
    assert wait_free(prefill.stage, decode.stage)


def test_the_first_token_comes_with_its_logprobs_before_any_ticket(stages):
    prefill, decode = stages
    p = random_prompts(1, 96, [30], seed=6)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    first, deltas, done = disaggregated(prefill, decode, "lp", p, params, ticket_first=False)
    (lp,) = first.delta.logprobs  # computed before any ticket existed: it did not wait for the transfer
    assert len(lp.top) == 2 and lp.top[0][0] == lp.token_id == first.delta.token_ids[0]
    assert done.ok and len(_ids(first, deltas)) == 4
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas if d.token_ids)
    assert wait_free(prefill.stage, decode.stage)


def _send_once_landed(decode: Driver, request_id: str, frame) -> None:
    """Send ``frame`` to the decode stage as soon as the request's transfer is DONE, before the loop
    polled it: waited for on the loop thread, so no poll() runs in between, and the frame posted there
    runs right after, before the loop's next round."""
    stage = decode.stage

    def once_landed():
        deadline = time.monotonic() + 20
        while stage.receiver.core.ledger.for_request(request_id).state.name != "DONE":
            assert time.monotonic() < deadline, "the transfer never completed"
            time.sleep(0.001)
        decode.send(frame)

    stage.call(once_landed, timeout=30)


def test_decode_abort_as_the_kv_lands_frees_the_blocks(stages):
    """The abort reaches the decode loop after the transfer is DONE but before
    the loop polled it: no sequence waits for it, and the blocks are freed."""
    prefill, decode = stages
    p = random_prompts(1, 96, [30], seed=7)[0]
    decode.send(Reserve("late", p, GREEDY))
    ticket = decode.next("late")
    prefill.send(Prefill("late", p, GREEDY))
    prefill.send(Attach("late", ticket.ticket))
    _send_once_landed(decode, "late", Abort("late"))
    done, _ = prefill.until("late", PrefillDone)
    assert done.ok
    assert decode.stream("late")[-1].finish_reason == "abort"
    assert wait_free(prefill.stage, decode.stage)


def test_a_lost_sender_fails_an_unfinished_transfer_at_once_not_at_its_lease(stages):
    """The prefill replica went after its first token, before its KV landed: the decode replica
    ends the request with an error that names it (the frontend migrates it) and frees the blocks."""
    prefill, decode = stages
    p = random_prompts(1, 96, [30], seed=8)[0]
    decode.send(Reserve("orphan", p, GREEDY))
    assert isinstance(decode.next("orphan"), TicketReady)
    t0 = time.monotonic()
    decode.send(PrefillLost("orphan", "prefill-3"))
    (delta,) = decode.stream("orphan")
    assert (delta.finish_reason, delta.error) == (FinishReason.ERROR,
                                                  "KV transfer failed: prefill replica prefill-3 was lost")
    assert time.monotonic() - t0 < decode.stage.lease_s / 2  # not the lease's expiry
    assert wait_free(prefill.stage, decode.stage)


def test_a_lost_sender_whose_kv_had_landed_changes_nothing(reference, stages):
    """Its replica went after every layer and the commit landed, before the decode loop polled them."""
    prefill, decode = stages
    p = random_prompts(1, 96, [30], seed=9)[0]
    decode.send(Reserve("landed", p, GREEDY))
    ticket = decode.next("landed")
    prefill.send(Prefill("landed", p, GREEDY))
    prefill.send(Attach("landed", ticket.ticket))
    _send_once_landed(decode, "landed", PrefillLost("landed", "prefill-0"))
    first, _ = prefill.until("landed", FirstToken)
    deltas = decode.stream("landed")
    assert _ids(first, deltas) == reference.generate([p], GREEDY)[0].token_ids
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert wait_free(prefill.stage, decode.stage)


def _streamed_text(model_dir, prompt, params, token_ids) -> list[str]:
    """The text each token added, as a replica streams them (one step per token)."""
    from engine.output import OutputProcessor
    from engine.sequence import Sequence
    from engine.tokenizer import Tokenizer

    proc, seq = OutputProcessor(Tokenizer.from_folder(model_dir)), Sequence("t", prompt, params)
    proc.add(seq)
    texts = []
    for t in token_ids:
        seq.output_token_ids.append(t)
        texts.append(proc.process(seq, [t])[0].text)
    return texts


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=1.0, seed=11, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_a_request_resumed_after_some_of_its_tokens_goes_on_as_if_uninterrupted(model_dir, reference, stages,
                                                                                 params):
    """What a migrated request is: its tokens so far ride along, are computed
    with the prompt, and the new replicas go on after them, token for token
    and character for character (seeded draws too: they are a function of
    the position), disaggregated and colocated."""
    from engine.serving.frames import Submit

    prefill, decode = stages
    p = random_prompts(1, 96, [23], seed=12)[0]
    want = reference.generate([p], params)[0]
    texts = _streamed_text(model_dir, p, params, want.token_ids)
    assert "".join(texts) == want.text
    for k in (1, 6):
        sent = want.token_ids[:k]
        first, deltas, done = disaggregated(prefill, decode, f"resume-{k}", p, params, True, output_token_ids=sent)
        assert done.ok
        assert sent + _ids(first, deltas) == want.token_ids, k
        assert "".join(texts[:k]) + first.delta.text + "".join(d.text for d in deltas) == want.text, k
    colocated = Driver(decode.stage)
    colocated.send(Submit("resume-colocated", p, params, want.token_ids[:4]))
    deltas = colocated.stream("resume-colocated")
    assert want.token_ids[:4] + [t for d in deltas for t in d.token_ids] == want.token_ids
    assert "".join(texts[:4]) + "".join(d.text for d in deltas) == want.text
    assert wait_free(prefill.stage, decode.stage)


def test_a_reservation_waits_for_blocks_while_the_pool_is_short(reference, stages):
    """A decode replica whose pool is full queues a reservation (instead of
    refusing it) and answers it once blocks come back; an abort while it
    waits leaves nothing behind."""
    prefill, decode = stages
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    big = random_prompts(1, 96, [312], seed=13)[0]  # its KV: 20 of the 64 blocks
    for rid in ("big", "big-2", "big-3"):  # 4 blocks left
        decode.send(Reserve(rid, big, long))
        assert isinstance(decode.next(rid), TicketReady)
    p = random_prompts(1, 96, [100], seed=14)[0]  # 7 blocks
    decode.send(Reserve("small", p, GREEDY))
    decode.send(Reserve("gone", p, GREEDY))
    time.sleep(0.3)
    assert decode.channel.inbox("small").empty()  # waiting, not refused
    decode.send(Abort("gone"))
    decode.send(Abort("big"))  # its blocks come back: the oldest waiting reservation gets them
    assert [d.finish_reason for d in decode.stream("big")] == [FinishReason.ABORT]
    ticket = decode.next("small")
    assert isinstance(ticket, TicketReady)
    assert [d.finish_reason for d in decode.stream("gone")] == [FinishReason.ABORT]
    for rid in ("big-2", "big-3"):
        decode.send(Abort(rid))
    prefill.send(Prefill("small", p, GREEDY))
    prefill.send(Attach("small", ticket.ticket))
    first, _ = prefill.until("small", FirstToken)
    deltas = decode.stream("small")
    assert _ids(first, deltas) == reference.generate([p], GREEDY)[0].token_ids
    assert wait_free(prefill.stage, decode.stage)


def test_a_lost_sender_ends_a_reservation_still_waiting_for_blocks(stages):
    prefill, decode = stages
    big = random_prompts(1, 96, [312], seed=13)[0]  # its KV: 20 of the 64 blocks
    for rid in ("big", "big-2", "big-3"):  # 4 blocks left
        decode.send(Reserve(rid, big, GREEDY))
        assert isinstance(decode.next(rid), TicketReady)
    decode.send(Reserve("waits", random_prompts(1, 96, [100], seed=14)[0], GREEDY))  # 7 blocks: it waits
    decode.send(PrefillLost("waits", "prefill-1"))
    (delta,) = decode.stream("waits")
    assert (delta.finish_reason, delta.error) == (FinishReason.ERROR,
                                                  "KV transfer failed: prefill replica prefill-1 was lost")
    for rid in ("big", "big-2", "big-3"):  # blocks come back: no ticket for it any more
        decode.send(Abort(rid))
        assert [d.finish_reason for d in decode.stream(rid)] == [FinishReason.ABORT]
    time.sleep(0.3)
    assert decode.channel.inbox("waits").empty()
    assert wait_free(prefill.stage, decode.stage)


@pytest.mark.parametrize("ticket_first", [True, False], ids=["ticket-first", "ticket-after-prefill"])
def test_a_guided_request_across_the_seam_equals_the_engine(reference, stages, ticket_first):
    """The prefill replica samples the first token under the grammar; the
    decode replica rebuilds the grammar from it and goes on: the tokens equal
    the offline engine's guided run."""
    prefill, decode = stages
    spec = GuidedSpec.json_schema({"type": "object", "additionalProperties": False, "required": ["n"],
                                   "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}})
    params = SamplingParams(max_tokens=24, temperature=0, guided=spec)
    p = random_prompts(1, 96, [20], seed=11)[0]
    want = reference.generate(p, params)[0]
    assert want.finish_reason == "stop"
    first, deltas, done = disaggregated(prefill, decode, f"g-{ticket_first}", p, params, ticket_first)
    assert done.ok, done.error
    assert _ids(first, deltas) == want.token_ids and deltas[-1].finish_reason == "stop"
    assert wait_free(prefill.stage, decode.stage)


def test_a_grammar_the_replica_cannot_compile_is_refused_there(stages):
    """A spec no frontend checked: the replica refuses the request (its input,
    not a replica failure, so nothing migrates it) and holds nothing for it."""
    prefill, decode = stages
    params = SamplingParams(max_tokens=8, temperature=0, guided=GuidedSpec("regex", "(unclosed"))
    p = random_prompts(1, 96, [10], seed=12)[0]
    prefill.send(Prefill("bad-p", p, params))
    decode.send(Submit("bad-d", p, params))
    for driver, rid in ((prefill, "bad-p"), (decode, "bad-d")):
        event = driver.next(rid)
        assert isinstance(event, Refused) and "regex: cannot be compiled" in event.error, event
    assert wait_free(prefill.stage, decode.stage)
