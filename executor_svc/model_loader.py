"""Load a decoder-only transformers model with the paged attention plugged in.

Weights come from the model directory (safetensors) or, with `dummy`, from a seeded random
initialisation of its config. The fingerprint identifies config + weights: the allocator mixes
it into block hashes, so two executors share prefix-cache entries only when it matches.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from executor_svc.attention import ATTENTION_NAME, register_attention
from executor_svc.lm_head import speed_up_lm_head

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """The model directory cannot be loaded; the message says what is missing."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: PreTrainedModel
    config: PretrainedConfig
    name: str
    fingerprint: str
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_position_embeddings(self) -> int:
        return int(self.config.max_position_embeddings)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fingerprint(config: PretrainedConfig, weights: str) -> str:
    """sha256 over the canonical config and the weights' identity, hex."""
    digest = hashlib.sha256()
    config_dict = config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "_attn_implementation"):
        config_dict.pop(volatile, None)
    digest.update(json.dumps(config_dict, sort_keys=True, default=str).encode())
    digest.update(weights.encode())
    return digest.hexdigest()


def _weights_identity(path: Path) -> str:
    """sha256 of every safetensors file's contents, in name order.

    NOTE: the whole contents, not the headers: two fine-tunes of one model have identical
    headers and sizes, and must never share prefix-cache entries.
    """
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {path}; use --load-format dummy for a config")
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return "safetensors:" + digest.hexdigest()


def _eos_ids(config: PretrainedConfig) -> tuple[int, ...]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(x) for x in eos) if isinstance(eos, list | tuple) else (int(eos),)


def load_model(
    path: str, load_format: str, dtype_flag: str, device_flag: str, seed: int
) -> LoadedModel:
    directory = Path(path)
    device = torch.device(device_flag)
    dtype = resolve_dtype(dtype_flag, device)
    register_attention()
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read a transformers config in {directory}: {exc}") from exc
    if load_format == "dummy":
        torch.manual_seed(seed)
        with device:  # initialise in place: an 8B model is never built on the CPU first
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=ATTENTION_NAME
            )
        weights = f"dummy:seed={seed}"
    else:
        weights = _weights_identity(directory)
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=dtype, attn_implementation=ATTENTION_NAME, local_files_only=True
        )
    model = model.to(device).eval()
    model.requires_grad_(False)
    if device.type == "cpu":
        speed_up_lm_head(model)
    loaded = LoadedModel(
        model=model,
        config=model.config,
        name=directory.resolve().name,
        fingerprint=fingerprint(config, weights),
        dtype=dtype,
        device=device,
        eos_token_ids=_eos_ids(config),
    )
    log.info(
        "model_loaded",
        model=loaded.name,
        load_format=load_format,
        dtype=dtype_name(dtype),
        device=str(device),
        num_params=sum(p.numel() for p in model.parameters()),
        fingerprint=loaded.fingerprint[:16],
    )
    return loaded
