"""Incremental detokenization against the offline tiny-llama tokenizer (byte-level BPE)."""

from __future__ import annotations

import pytest

from gateway.text.detokenizer import Detokenizer
from gateway.text.tokenizer import Tokenizer

TEXT = "Hello wörld, ünïcode 日本語 test — done."


@pytest.fixture(scope="module", params=["rust-stream", "window"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    # Both text streams: the tokenizers DecodeStream, and the decode-a-window fallback.
    loaded = Tokenizer.load("models/tiny-llama")
    return loaded if request.param == "rust-stream" else Tokenizer(hf=loaded.hf, fast=None)


def stream(tok: Tokenizer, prompt: list[int], ids: list[int], stop: tuple[str, ...] = ()):
    detok = Detokenizer.for_prompt(tok, prompt, stop)
    deltas = []
    for t in ids:
        deltas.append(detok.add(t))
        if detok.stopped:
            return deltas, True
    deltas.append(detok.flush())
    return deltas, False


def test_detokenizer_stream_equals_full_decode(tokenizer: Tokenizer):
    # Token by token, the concatenated deltas equal one decode of all the output tokens.
    ids = tokenizer.encode(TEXT)
    prompt, output = ids[:3], ids[3:]
    deltas, stopped = stream(tokenizer, prompt, output)
    assert not stopped
    assert "".join(deltas) == tokenizer.decode(output)


def test_detokenizer_never_splits_a_multibyte_character(tokenizer: Tokenizer):
    # '日本語' takes several byte tokens per character: no delta holds U+FFFD.
    ids = tokenizer.encode("x 日本語 ü")
    deltas, _ = stream(tokenizer, ids[:1], ids[1:])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids[1:])


def test_detokenizer_stop_string_truncates_and_stops(tokenizer: Tokenizer):
    # The stop string and what follows it never reach the client.
    ids = tokenizer.encode("alpha beta STOP gamma")
    deltas, stopped = stream(tokenizer, ids[:1], ids[1:], stop=("STOP",))
    assert stopped
    assert "".join(deltas) == tokenizer.decode(ids[1:]).split("STOP")[0]


def test_detokenizer_holds_back_a_possible_stop_prefix(tokenizer: Tokenizer):
    # "ST" could start "STOP": it is held back, then released when the text diverges.
    ids = tokenizer.encode("a STAR b")
    detok = Detokenizer.for_prompt(tokenizer, ids[:1], ("STOP",))
    released = ""
    for t in ids[1:]:
        released += detok.add(t)
        assert not tokenizer.decode(ids[1:]).startswith(released + "X")  # sanity
        assert len(detok.text) - len(released) <= 3
    released += detok.flush()
    assert released == tokenizer.decode(ids[1:])


def test_detokenizer_invalid_bytes_decode_like_a_full_decode(tokenizer: Tokenizer):
    # A lone continuation byte, then text, then an unfinished lead byte at the very end.
    ids = [117, 42, 439, 130, 42, 439, 130]
    deltas, _ = stream(tokenizer, [1], ids)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_detokenizer_skips_special_tokens(tokenizer: Tokenizer):
    # EOS (id 2) adds no text.
    detok = Detokenizer.for_prompt(tokenizer, [1], ())
    assert detok.add(2) == ""
    assert detok.flush() == ""


def test_detokenizer_prompt_ending_mid_character_does_not_leak_into_output(
    tokenizer: Tokenizer,
):
    # The prompt ends with the first byte of a two-byte character; output is plain text.
    prompt = [1, 42, 130]
    output = tokenizer.encode("hello there")[1:]
    deltas, _ = stream(tokenizer, prompt, output)
    assert "".join(deltas) == tokenizer.decode(output)


def _reference_earliest(text: str, stops: list[str], new_from: int) -> int:
    """Every occurrence of every stop string, found by brute force."""
    starts = [start for s in stops for start in range(len(text) - len(s) + 1)
              if text[start:start + len(s)] == s and start + len(s) - 1 >= new_from]
    return min(starts, default=-1)


def test_stop_string_index_finds_the_earliest_match_like_a_brute_force_scan():
    # Overlapping, nested and repeated stops over a small alphabet: the indexed search (only
    # the strings that can end at each new character) agrees with scanning every string.
    import random

    from gateway.text.detokenizer import StopStrings

    rng = random.Random(7)
    for _ in range(2000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 12)))
        new_from = rng.randint(0, len(text))
        assert StopStrings.of(stops).earliest_match(text, new_from)[0] == _reference_earliest(
            text, stops, new_from), (stops, text, new_from)


def test_detokenizer_keeps_the_stop_string_when_asked(tokenizer: Tokenizer):
    # include_stop_str_in_output: the text ends right after the stop string, not before it.
    ids = tokenizer.encode("alpha beta STOP gamma")
    detok = Detokenizer.for_prompt(tokenizer, ids[:1], ("STOP",), include_stop=True)
    released = ""
    for t in ids[1:]:
        released += detok.add(t)
        if detok.stopped:
            break
    assert detok.stopped
    full = tokenizer.decode(ids[1:])
    assert released == full[: full.index("STOP") + len("STOP")]


def test_detokenizer_ignores_stop_strings_while_told_to(tokenizer: Tokenizer):
    # min_tokens: a stop string in text added with find_stop=False ends nothing.
    ids = tokenizer.encode("a STOP b")
    detok = Detokenizer.for_prompt(tokenizer, ids[:1], ("STOP",))
    released = "".join(detok.add(t, find_stop=False) for t in ids[1:]) + detok.flush()
    assert not detok.stopped
    assert released == tokenizer.decode(ids[1:])


def test_detokenizer_keeps_special_tokens_when_asked(tokenizer: Tokenizer):
    # skip_special_tokens=False: EOS decodes to its own text, as a full decode does.
    detok = Detokenizer.for_prompt(tokenizer, [1], (), skip_special_tokens=False)
    text = detok.add(5) + detok.add(2) + detok.flush()
    assert text == tokenizer.hf.decode([5, 2], skip_special_tokens=False)
    assert tokenizer.hf.eos_token in text
