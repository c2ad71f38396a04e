"""The tokenizer, loaded offline from the model preset directory (AutoTokenizer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class Tokenizer:
    hf: Any  # transformers.PreTrainedTokenizerBase

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        from transformers import AutoTokenizer

        return cls(hf=AutoTokenizer.from_pretrained(path))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.hf.eos_token_id
        return () if eos is None else (int(eos),)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        try:
            return [int(t) for t in self.hf.encode(text)]
        except Exception as exc:  # noqa: BLE001 - a tokenizer error is the caller's input
            raise InvalidArgument(f"prompt text could not be tokenized: {exc}") from exc

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))
