"""The most input bytes one token can stand for: a prompt's length checked before tokenizing.

A tokenizer whose tokens each cover at most `max_token_bytes` bytes of the input turns a text
of B UTF-8 bytes into at least ceil(B / max_token_bytes) tokens (special tokens such as BOS
cover none and only add to that). So a text longer than (max_model_len - 1) x max_token_bytes
bytes cannot fit, and is refused without being tokenized. Bytes the vocabulary cannot spell
are dropped by BPE without an unknown token (SmolLM2 has no symbol for the control characters
0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, nor for the lead bytes 0xf1 and 0xf2 of the code points
U+40000-U+BFFFF): they are counted out first, one byte for each character that holds one.

The bound is read from the tokenizer's own description (tokenizer.json) and given only where
it is sound, which is every tokenizer shipped in models/ (byte-level BPE) and SentencePiece
conversions (Metaspace or a `▁` normalizer, byte fallback):
- a BPE model whose every input byte reaches some token, or is dropped alone: byte-level (the
  byte symbols missing from the vocabulary are ASCII or lead bytes: a character loses one
  byte at most), byte fallback (all 256 `<0xXX>` tokens), or an unknown token that is not
  fused (one character each). Unknown characters dropped, or fused into one `<unk>`, would
  let a single token (or none) stand for any number of bytes;
- normalizers that never shrink the text (Prepend, Replace by something no shorter): tokens
  are counted over the normalized text, which is then at least as long as the input; and one
  Unicode normal form (Qwen2's NFC), which may shrink it: the bound counts the bytes of the
  text in that form (the shorter of it and the text itself: a Unicode version that knows a
  character the tokenizer's does not only ever decomposes it, which adds bytes);
- pre-tokenizers that drop nothing (ByteLevel, Metaspace, Split, Digits, Punctuation, unless
  told to remove what they match);
- added tokens that match only their own text (no lstrip/rstrip, which swallow whitespace).
Anything else gives None: the prompt is tokenized whole, as before, and the gateway says so
at start. A token's length is its characters under byte-level BPE (one symbol a byte) and its
UTF-8 bytes otherwise (`▁`, three bytes, stands for a one-byte space: an overestimate,
which keeps the bound sound).
"""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass
from typing import Any

# Normalizers that only ever add to the text (Replace is checked for its lengths).
GROWING_NORMALIZERS = frozenset({"Prepend", "Replace", "Sequence"})
# Unicode normal forms (they may shrink a text: U+212A KELVIN SIGN, 3 bytes, is "K"): the
# bound counts the bytes of the text in that form, as Python's unicodedata writes it.
NORMAL_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "Sequence"})
# Bytes that valid UTF-8 never holds (a Python str cannot bring them).
NOT_UTF8 = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})


@dataclass(frozen=True, slots=True)
class TokenBound:
    """At most `max_token_bytes` input bytes per token; `dropped`: the UTF-8 bytes no token
    spells (ASCII characters, or lead bytes: each occurrence is one byte lost)."""

    max_token_bytes: int
    dropped: tuple[bytes, ...] = ()
    normal_form: str | None = None  # one of NORMAL_FORMS, applied before counting

    def min_num_tokens(self, text: str) -> int:
        """The fewest tokens `text` can be, special tokens aside."""
        if self.normal_form is not None and not text.isascii():  # ASCII is in every form
            normal = unicodedata.normalize(self.normal_form, text)  # type: ignore[arg-type]
            text = min(text, normal, key=_utf8_len)
        data = text.encode("utf-8", "surrogatepass")
        num_bytes = len(data) - sum(data.count(b) for b in self.dropped)
        return math.ceil(num_bytes / self.max_token_bytes)


def token_bound(backend: Any) -> TokenBound | None:
    """The bound for a `tokenizers.Tokenizer` (the fast tokenizer's backend), or None where
    it cannot be shown sound."""
    if backend is None:
        return None
    return bound_of(json.loads(backend.to_str()))


def bound_of(spec: dict[str, Any]) -> TokenBound | None:
    """The bound from a tokenizer.json document (module docstring), or None."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return None
    normalizer = spec.get("normalizer")
    forms = _normal_forms(normalizer)
    if len(forms) > 1 or not _grows(normalizer) or not _keeps(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    if not vocab:
        return None
    dropped: tuple[bytes, ...] = ()
    if _has(spec.get("pre_tokenizer"), "ByteLevel"):
        missing = _unspelled_bytes(vocab)
        if missing is None:
            return None
        dropped = tuple(bytes([b]) for b in missing)
        longest = max(len(token) for token in vocab)  # one symbol a byte
    elif _byte_fallback(model, vocab):
        longest = max(len(token.encode("utf-8", "surrogatepass")) for token in vocab)
    elif model.get("unk_token") in vocab and not model.get("fuse_unk"):
        longest = max(4, *(len(t.encode("utf-8", "surrogatepass")) for t in vocab))
    else:
        return None  # unknown characters dropped, or fused into one token
    longest_added = max((len(a["content"].encode("utf-8", "surrogatepass")) for a in added),
                        default=0)
    return TokenBound(max(longest, longest_added, 1), dropped, forms[0] if forms else None)


def _byte_fallback(model: dict[str, Any], vocab: dict[str, int]) -> bool:
    return bool(model.get("byte_fallback")) and all(
        f"<0x{b:02X}>" in vocab for b in range(256))


def _byte_level_symbols() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (the byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    symbols = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in symbols):
        symbols[b] = chr(256 + extra)
    return symbols


def _unspelled_bytes(vocab: dict[str, int]) -> list[int] | None:
    """The UTF-8 bytes with no symbol in a byte-level vocabulary; None where one is a
    continuation byte (a character would lose more than its byte)."""
    missing = [b for b, c in _byte_level_symbols().items()
               if c not in vocab and b not in NOT_UTF8]
    return None if any(0x80 <= b < 0xC0 for b in missing) else missing


def _grows(normalizer: dict[str, Any] | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind in NORMAL_FORMS:
        return True  # counted in that form (TokenBound.normal_form)
    if kind not in GROWING_NORMALIZERS:
        return False
    if kind == "Sequence":
        return all(_grows(n) for n in normalizer.get("normalizers") or [])
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        if "String" not in pattern:
            return False  # a regex may match more than its replacement
        return len(str(normalizer.get("content", "")).encode()) >= len(
            str(pattern["String"]).encode())
    return True


def _normal_forms(normalizer: dict[str, Any] | None) -> list[str]:
    if normalizer is None:
        return []
    if normalizer.get("type") == "Sequence":
        return [f for n in normalizer.get("normalizers") or [] for f in _normal_forms(n)]
    return [normalizer["type"]] if normalizer.get("type") in NORMAL_FORMS else []


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _keeps(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind not in KEEPING_PRE_TOKENIZERS or pre.get("behavior") == "Removed":
        return False
    if kind == "Sequence":
        return all(_keeps(p) for p in pre.get("pretokenizers") or [])
    return True


def _has(pre: dict[str, Any] | None, kind: str) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_has(p, kind) for p in pre.get("pretokenizers") or [])
    return bool(pre.get("type") == kind)
