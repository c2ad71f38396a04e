"""What the client tests need of the shared tiny stack (tests/e2e/e2e_stack.py
`start_tiny_stack`): the prompt its gateway renders for a chat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer


def chat_prompt_ids(model: Path, messages: list[dict[str, str]]) -> list[int]:
    """The prompt the gateway renders for `messages` (gateway/text/tokenizer.py's way)."""
    tokenizer: Any = AutoTokenizer.from_pretrained(model)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
