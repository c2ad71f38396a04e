"""What a simulated executor reports of its model, read from the directory's JSON files alone
(no transformers, no torch): the same vocabulary, EOS ids and length limit the real executor
reports for that directory, so a gateway with its tokenizer serves either.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.model_dirs import missing_model_message
from executor_svc.settings import SettingsError
from executor_svc.simulated.token_model import ROOT_DIGEST

# Part of the fingerprint: change it with anything that changes the tokens for a context.
TOKEN_MODEL_VERSION = "splitmix64-v1"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    fingerprint: str
    # The KV shape a real executor of this config would have (Describe's kv_layout);
    # 0 where the config does not say.
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SettingsError(f"--model: cannot read {path} ({exc})") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"--model: {path} does not hold a JSON object")
    return data


def _eos_ids(*sources: Any) -> tuple[int, ...]:
    """EOS ids of the config, then of the generation config, each once (model_loader's rule)."""
    ids: list[int] = []
    for eos in sources:
        for token_id in eos if isinstance(eos, list | tuple) else [eos]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def read_model_config(model: str, simulated_model: str) -> ModelConfig:
    """`simulated_model` (the profile's, e.g. llama3-8b) goes into the fingerprint, which
    also says "simulated": a simulated pool never shares prefix-cache entries with a real
    model's, nor with another token model's."""
    directory = Path(model)
    if not directory.is_dir():
        raise SettingsError(missing_model_message("--model", model))
    config = _read(directory / "config.json")
    generation = directory / "generation_config.json"
    eos = _eos_ids(config.get("eos_token_id"),
                   _read(generation).get("eos_token_id") if generation.is_file() else None)
    limit = int(config.get("max_position_embeddings") or config.get("n_positions") or 2048)
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True):
        limit = min(limit, int(window))  # as the real executor caps it
    vocab_size = int(config["vocab_size"]) if "vocab_size" in config else 0
    if vocab_size <= 0:
        raise SettingsError(f"--model: {directory / 'config.json'} has no vocab_size")
    name = directory.resolve().name
    identity = json.dumps({"config": config, "token_model": TOKEN_MODEL_VERSION,
                           "root": ROOT_DIGEST}, sort_keys=True, default=str)
    digest = hashlib.sha256(identity.encode()).hexdigest()
    heads = int(config.get("num_attention_heads") or 0)
    head_dim = config.get("head_dim") or (int(config.get("hidden_size") or 0) // heads
                                          if heads else 0)
    return ModelConfig(
        name=name,
        vocab_size=vocab_size,
        eos_token_ids=eos,
        max_position_embeddings=limit,
        fingerprint=f"simulated:{simulated_model}:{name}:{digest}",
        num_layers=int(config.get("num_hidden_layers") or 0),
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
    )
