"""The fewest tokens a text can be, before tokenizing it (text/token_bound.py): sound for every
tokenizer shipped in models/ and for SentencePiece-style ones, absent where it cannot be."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from common.model_dirs import REPO_ROOT
from gateway.text.token_bound import TokenBound, bound_of, token_bound
from tests.budget import examples

SHIPPED = ["smollm2-135m-instruct", "tiny-llama", "tiny-llama-hd128", "tiny-qwen2",
           "tiny-mistral", "small-llama"]
CORPUS = REPO_ROOT / "models" / "tokenizer_corpus.txt"


def _sentencepiece_style(pre_tokenizer: bool) -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer (a `▁` normalizer, or Metaspace) with byte fallback, trained
    here on the corpus (no SentencePiece tokenizer ships in models/)."""
    rust = RustTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if pre_tokenizer:
        rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        rust.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=[], show_progress=False)
    rust.train([str(CORPUS)], trainer)
    rust.add_tokens(byte_tokens)  # byte fallback: every byte has its token
    return PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@cache
def _tokenizer(name: str) -> Any:
    if name == "sentencepiece-normalizer":
        return _sentencepiece_style(pre_tokenizer=False)
    if name == "sentencepiece-metaspace":
        return _sentencepiece_style(pre_tokenizer=True)
    return AutoTokenizer.from_pretrained(str(REPO_ROOT / "models" / name), local_files_only=True)


@cache
def _bound(name: str) -> TokenBound:
    bound = token_bound(_tokenizer(name).backend_tokenizer)
    assert bound is not None, f"{name}: no bound"
    return bound


@cache
def _pieces(name: str) -> list[str]:
    """Adversarial pieces: the vocabulary's longest tokens as text, every added token,
    whitespace runs, characters the vocabulary cannot spell."""
    hf = _tokenizer(name)
    vocab = hf.get_vocab()
    longest = sorted(vocab, key=len, reverse=True)[:40]
    texts = [hf.convert_tokens_to_string([t]) for t in longest]
    texts += [str(a) for a in hf.get_added_vocab()]
    return [*texts, " " * 40, "\n" * 17, "\t \t", "\x04\x06\x13\x14\x16\x1d", "\U00050000",
            "é", "e\u0301", "\u212a", "\u1100\u1161\u11a8", "日本語", "🙂", "▁▁", "<0x41>"]


NAMES = [*SHIPPED, "sentencepiece-normalizer", "sentencepiece-metaspace"]


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_token_bound_never_exceeds_the_real_count(name: str, data: st.DataObject) -> None:
    # Random unicode mixed with the vocabulary's longest tokens, added tokens, whitespace and
    # unspellable characters: the real count (with the tokenizer's special tokens, as the
    # gateway encodes) is never below the bound, so a prompt that fits is never refused.
    hf = _tokenizer(name)
    pieces = _pieces(name)
    parts = data.draw(st.lists(
        st.one_of(st.text(max_size=20), st.sampled_from(pieces),
                  st.tuples(st.sampled_from(pieces), st.integers(1, 30)).map(
                      lambda p: p[0] * p[1])),
        max_size=30))
    text = "".join(parts)
    assert len(hf.encode(text)) >= _bound(name).min_num_tokens(text)


@pytest.mark.parametrize("name", NAMES)
def test_token_bound_holds_on_the_longest_token_repeated(name: str) -> None:
    # The tightest case for the bound: the longest token's text over and over, and the
    # corpus itself; the bound stays below, and within a factor that refuses 1 MiB at once.
    hf = _tokenizer(name)
    bound = _bound(name)
    for piece in _pieces(name)[:5]:
        text = piece * 200
        assert len(hf.encode(text)) >= bound.min_num_tokens(text)
    corpus = CORPUS.read_text()
    assert len(hf.encode(corpus)) >= bound.min_num_tokens(corpus)
    assert bound.min_num_tokens("x" * (1 << 20)) > 2048  # 1 MiB never fits 2,048 tokens


def test_token_bound_of_the_shipped_tokenizers() -> None:
    # Byte-level BPE: the longest token's symbols; SmolLM2 cannot spell six control
    # characters and two lead bytes, which are counted out.
    assert _bound("smollm2-135m-instruct").max_token_bytes == 81
    assert set(_bound("smollm2-135m-instruct").dropped) == {
        b"\x04", b"\x06", b"\x13", b"\x14", b"\x16", b"\x1d", b"\xf1", b"\xf2"}
    assert _bound("smollm2-135m-instruct").min_num_tokens("\x04" * 1000 + "a" * 81) == 1
    assert _bound("tiny-llama").max_token_bytes == 10
    assert _bound("small-llama").max_token_bytes == 24


def _spec(name: str) -> dict[str, Any]:
    return json.loads(Path(REPO_ROOT / "models" / name / "tokenizer.json").read_text())


@pytest.mark.parametrize("change", [
    lambda s: s.update(normalizer={"type": "Lowercase"}),  # may shrink the text (K: 3 -> 1)
    lambda s: s.update(pre_tokenizer={"type": "Whitespace"}),  # drops whitespace
    lambda s: s["added_tokens"][0].update(rstrip=True),  # swallows the whitespace after it
    lambda s: s["model"].update(type="Unigram"),
    lambda s: s["model"]["vocab"].pop("Ģ"),  # byte-level 0x80, a continuation byte
])
def test_token_bound_is_none_where_it_cannot_be_shown_sound(change: Any) -> None:
    # Each rule that could let one token (or none) stand for unbounded bytes: no bound.
    spec = _spec("tiny-llama")
    assert bound_of(spec) is not None
    change(spec)
    assert bound_of(spec) is None


def test_token_bound_is_none_for_fused_unknowns() -> None:
    # Without byte fallback, a fused <unk> stands for any run of unknown characters.
    rust = RustTokenizer(models.BPE(vocab={"<unk>": 0, "a": 1}, merges=[], unk_token="<unk>",
                                    fuse_unk=True))
    assert token_bound(rust) is None
