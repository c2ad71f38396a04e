"""The stack the client tests run against: allocator, executor and gateway as subprocesses
on port 0 (e2e_stack's machinery). Its model is a copy of the tiny-llama preset (random
weights, seeded: the transformers reference rebuilds them) with a chat template, so that chat
calls have something to render."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from tests.e2e.e2e_stack import MODEL, Clients, start_stack

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json")


def chat_model(directory: Path) -> Path:
    directory.mkdir()
    for name in MODEL_FILES:
        shutil.copy(Path(MODEL) / name, directory / name)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return directory


def chat_prompt_ids(model: Path, messages: list[dict[str, str]]) -> list[int]:
    """The prompt the gateway renders for `messages` (gateway/text/tokenizer.py's way)."""
    tokenizer: Any = AutoTokenizer.from_pretrained(model)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def start_client_stack(root: Path) -> Clients:
    stack = start_stack(root, model=str(chat_model(root / "model")),
                        executor_args=("--load-format", "dummy", "--num-blocks", "256"))
    return Clients(stack)
