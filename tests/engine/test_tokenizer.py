"""engine.tokenizer on the default model's tokenizer."""
from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

MULTIBYTE = "Grüße 👋🏽 你好，世界！🇫🇷 — ok 🎉🎉"


@pytest.fixture(scope="module")
def tok(default_model_dir) -> Tokenizer:
    return Tokenizer.from_folder(default_model_dir)


def stream(tok, ids, prompt_ids=(), chunk=1, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `ids` `chunk` at a time; the deltas (flush included) and the detokenizer."""
    det = IncrementalDetokenizer(tok, list(prompt_ids), **kw)
    deltas = [det.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(det.flush())
    return deltas, det


def test_encode_decode_round_trip(tok):
    text = "Hello, world! The year is 2024.\n\tIndented: " + MULTIBYTE
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_special_ids_and_vocab(tok):
    assert tok.bos_token_id == 1
    assert 2 in tok.eos_token_ids  # <|im_end|>
    assert tok.vocab_size == 49152
    assert tok.decode([2], skip_special_tokens=False) == "<|im_end|>"
    assert tok.decode([2]) == ""


def test_chat_template(tok):
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    prompt = tok.apply_chat_template(messages)

    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def _copy_tokenizer(src, dst):
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, dst / name)


def test_missing_chat_template_is_a_clear_error(default_model_dir, tmp_path):
    folder = tmp_path / "plain"
    _copy_tokenizer(default_model_dir, folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template")
    cfg_path.write_text(json.dumps(cfg))

    tok = Tokenizer.from_folder(folder)

    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_eos_ids_gather_generation_config(default_model_dir, tmp_path):
    folder = tmp_path / "gen"
    _copy_tokenizer(default_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))

    assert Tokenizer.from_folder(folder).eos_token_ids == {0, 2}


def test_folder_without_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


# --- IncrementalDetokenizer ---------------------------------------------------


def test_multibyte_characters_stream_whole(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    # The test means something only if some characters span several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)

    deltas, det = stream(tok, ids, prompt_ids=tok.encode("Say hi: "))

    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == det.text == tok.decode(ids) == MULTIBYTE


def test_first_token_keeps_its_leading_space(tok):
    prompt = tok.encode("Hello")
    ids = tok.encode(" there, friend", add_special_tokens=False)

    deltas, _ = stream(tok, ids, prompt_ids=prompt)

    assert deltas[0] == " there"


def test_special_tokens_kept_or_skipped(tok):
    ids = tok.encode("Done.", add_special_tokens=False) + [2]

    assert "".join(stream(tok, ids)[0]) == "Done."
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == "Done.<|im_end|>"


def test_stop_string_split_across_tokens(tok):
    stop = "\n\nUser:"
    ids = tok.encode("Sure thing.\n\nUser: and then more text", add_special_tokens=False)
    assert len(tok.encode(stop, add_special_tokens=False)) > 1

    det = IncrementalDetokenizer(tok, [], stop=[stop])
    deltas = [det.step([i]) for i in ids]

    assert det.stopped
    assert "".join(deltas) == det.text == "Sure thing."
    assert det.step(tok.encode(" more", add_special_tokens=False)) == ""
    assert det.flush() == ""
    assert det.text == "Sure thing."


def test_stop_prefix_is_held_then_released(tok):
    ids = tok.encode("We STand firm. Then STOP now", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [], stop=["STOP"])

    emitted = ""
    for i in ids:
        emitted += det.step([i])
        assert not emitted.endswith("ST")  # a possible stop start is never shown early

    assert det.stopped
    assert emitted == det.text == "We STand firm. Then "


def test_held_stop_prefix_comes_out_at_flush(tok):
    ids = tok.encode("It ends with ST", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [], stop=["STOP"])

    before = "".join(det.step([i]) for i in ids)

    assert before.startswith("It ends with") and not before.endswith(("S", "ST"))
    assert before + det.flush() == "It ends with ST"
    assert not det.stopped
    assert det.text == "It ends with ST"


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)

    deltas, det = stream(tok, ids, chunk=len(ids), stop=["delta", " beta", "gamma"])

    assert det.stopped
    assert "".join(deltas) == "alpha"


def test_decodes_only_a_window(tok):
    """Each step costs the same however long the output grows."""
    lengths: list[int] = []

    class Recording:
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode(("The quick brown fox jumps over the lazy dog. " + MULTIBYTE) * 20,
                     add_special_tokens=False)
    deltas, _ = stream(Recording(), ids, prompt_ids=tok.encode("A prompt of some length, " * 10))

    assert "".join(deltas) == tok.decode(ids)
    assert len(ids) > 300 and max(lengths) <= 16


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5])
def test_characters_never_align_with_chunks(tok, chunk):
    """Runs of 4-byte characters, one token per byte, fed so that chunk ends
    rarely fall between characters: every whole character still comes out,
    and no part of one."""
    text = "\U000c0000" * 12 + "ok" + "\u0800\U0001f600" * 6
    ids = tok.encode(text, add_special_tokens=False)

    deltas, _ = stream(tok, ids, chunk=chunk)

    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text
    assert max(len(d) for d in deltas) <= 4  # characters come out as they complete


@settings(max_examples=60, deadline=None)
@example(text="\x80\u0800\U000c0000\U000c0000\U000c0000", prompt="", chunk=4)
@given(text=st.text(max_size=40), prompt=st.text(max_size=10), chunk=st.integers(1, 4))
def test_deltas_add_up_to_the_full_decode(tok, text, prompt, chunk):
    ids = tok.encode(text, add_special_tokens=False)

    deltas, det = stream(tok, ids, prompt_ids=tok.encode(prompt), chunk=chunk)

    assert "".join(deltas) == det.text == tok.decode(ids)
    if "\ufffd" not in tok.decode(ids):  # the vocabulary lacks a few bytes, e.g. 0xF1
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=60, deadline=None)
@example(text="a😀a", stop=["😀", "a😀a"], chunk=1)  # the later-starting stop string completes first
@given(text=st.text(alphabet="ab \n😀", max_size=30),
       stop=st.lists(st.text(alphabet="ab \n😀", min_size=1, max_size=3), max_size=3),
       chunk=st.integers(1, 3))
def test_output_ends_before_the_first_stop_string(tok, text, stop, chunk):
    """Generation stops at the first stop string to appear: the output is the
    text up to where some stop string begins, holds no stop string, and is cut
    no later than the point where the earliest-completing stop string ends.
    (When one delta completes several stop strings, any of them may cut.)"""
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    ends = [i + len(s) for s, i in ((s, full.find(s)) for s in stop) if i >= 0]

    deltas, det = stream(tok, ids, chunk=chunk, stop=stop)

    out = det.text
    assert "".join(deltas) == out and full.startswith(out)
    assert not any(s in out for s in stop)
    assert det.stopped == bool(ends)
    if ends:
        assert any(full.startswith(s, len(out)) for s in stop)  # cut where a stop string begins
        assert len(out) < min(ends)  # ... one that had appeared by the first completion
    else:
        assert out == full
