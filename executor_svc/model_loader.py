"""Load a decoder-only transformers model with the paged attention plugged in.

Weights come from the model directory (safetensors) or, with `dummy`, from a seeded random
initialisation of its config. `auto` never serves random weights silently: a directory without
safetensors is refused (with what to do), except a config-only preset shipped in `models/`,
which gets dummy weights and a WARNING. The fingerprint identifies config + weights: the
allocator mixes it into block hashes, so two executors share prefix-cache entries only when it
matches.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.auto_factory import _get_model_class

from common.model_dirs import FOREIGN_SUFFIXES, TOKENIZER_FILES, ModelDir
from executor_svc.attention import ATTENTION_NAME, AttentionShape, register_attention
from executor_svc.cpu_kernels import load as load_cpu_kernels
from executor_svc.fused_layers import fuse_layers
from executor_svc.layer_loop import LayerLoop
from executor_svc.lm_head import speed_up_lm_head
from executor_svc.lora import Adapters, LoraSpec
from executor_svc.packed_linear import matmul_library, onednn_packs_bfloat16, pack_linears

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
    adapters: Adapters | None = None  # LoRA slots (None: LoRA off)
    layer_loop: LayerLoop | None = None  # the fused decoder's own forward (None: transformers')

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_position_embeddings(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def attention_shape(self) -> AttentionShape:
        """Query heads and the softmax scale of the model's attention layers (the first
        layer's: every layer of a decoder shares them)."""
        for module in self.model.modules():
            scale = getattr(module, "scaling", None)
            if isinstance(getattr(module, "layer_idx", None), int) and scale is not None:
                return AttentionShape(int(self.config.num_attention_heads), float(scale))
        raise ModelLoadError(f"{type(self.model).__name__} has no attention layer with a scale")


def cpu_computes_bfloat16() -> bool:
    """The CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX) and oneDNN has kernels for
    it: there the executor's steps run 1.25x (one sequence) to 5x (a 2,048-token prefill)
    faster in bfloat16 than in float32 (bench/README.md, bench.auto_dtype). Elsewhere bfloat16
    is converted element by element, and float32 is the faster one."""
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return bool(native and onednn_packs_bfloat16())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: the fastest here: bfloat16 on CUDA and on CPUs that compute it in hardware,
    else float32."""
    if name == "auto":
        fast_bf16 = device.type == "cuda" or cpu_computes_bfloat16()
        return torch.bfloat16 if fast_bf16 else torch.float32
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fingerprint(config: PretrainedConfig, weights: str, dtype: torch.dtype) -> str:
    """sha256 over what makes two executors' KV interchangeable: the canonical config, the
    weights' identity and the dtype they run in (the same checkpoint in bf16 and fp32 computes
    different keys and values), hex. The device is left out: dummy weights are drawn on the CPU
    whatever the device (dummy_model), so a CUDA and a CPU executor of one seed share them."""
    digest = hashlib.sha256()
    config_dict = config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "_attn_implementation"):
        config_dict.pop(volatile, None)
    digest.update(json.dumps(config_dict, sort_keys=True, default=str).encode())
    digest.update(weights.encode())
    digest.update(dtype_name(dtype).encode())
    return digest.hexdigest()


def _weights_identity(files: tuple[Path, ...]) -> str:
    """sha256 of every safetensors file's contents, in name order.

    NOTE: the whole contents, not the headers: two fine-tunes of one model have identical
    headers and sizes, and must never share prefix-cache entries.
    """
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return "safetensors:" + digest.hexdigest()


def _eos_ids(directory: Path, config: PretrainedConfig) -> tuple[int, ...]:
    """EOS ids of the config and of the generation config, in that order, each once.

    Chat models often end a turn with a token only the generation config names.
    """
    ids: list[int] = []
    sources: list[Any] = [getattr(config, "eos_token_id", None)]
    if (directory / "generation_config.json").is_file():
        try:
            generation = GenerationConfig.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"unreadable generation_config.json in {directory}: {exc}"
            ) from exc
        sources.append(generation.eos_token_id)
    for eos in sources:
        for token_id in eos if isinstance(eos, list | tuple) else [eos]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def choose_weights(found: ModelDir, load_format: str) -> str:
    """"safetensors" or "dummy" for this directory, or ModelLoadError saying what to do."""
    if load_format == "dummy":
        return "dummy"
    if found.weight_files:
        if not found.has_tokenizer:
            raise ModelLoadError(
                f"no tokenizer in {found.path} (looked for {', '.join(TOKENIZER_FILES)}): copy "
                "the model's tokenizer files next to its weights; the gateway needs them"
            )
        return "safetensors"
    if found.foreign_files:
        first = found.foreign_files[0]
        raise ModelLoadError(f"{first} is {FOREIGN_SUFFIXES[first.suffix]}")
    if found.is_preset:
        log.warning(
            "dummy_weights",
            model=found.path.name,
            reason="a config-only preset: random weights (seeded), output is not meaningful",
        )
        return "dummy"
    raise ModelLoadError(
        f"no *.safetensors weights in {found.path}: put the model's weights there, or pass "
        "--load-format dummy to serve random weights on purpose"
    )


def _check_architecture(config: PretrainedConfig) -> None:
    """Decoder-only models that call transformers' attention interface can be served."""
    try:
        model_class = _get_model_class(config, AutoModelForCausalLM._model_mapping)
    except (KeyError, ValueError) as exc:
        kind = getattr(config, "model_type", "?")
        raise ModelLoadError(
            f"architecture {kind!r} is not a causal LM transformers can build: serve a "
            "decoder-only model (Llama, Qwen2/3, Mistral, ...)"
        ) from exc
    if config.is_encoder_decoder or not model_class.__name__.endswith("ForCausalLM"):
        raise ModelLoadError(
            f"{model_class.__name__} is not a decoder-only *ForCausalLM model: serve a Llama, "
            "Qwen2/3 or Mistral-style model"
        )
    if not getattr(model_class, "_supports_attention_backend", False):
        raise ModelLoadError(
            f"{model_class.__name__} does not use transformers' attention interface, so paged "
            "attention cannot be plugged in: serve a Llama, Qwen2/3 or Mistral-style model"
        )


def dummy_model(config: PretrainedConfig, dtype: torch.dtype, seed: int,
                attn_implementation: str = ATTENTION_NAME) -> PreTrainedModel:
    """The seeded random weights of `--load-format dummy`, on the CPU.

    NOTE: drawn on the CPU whatever the device, then moved: CUDA's generator draws other
    numbers from the same seed, and a reference built anywhere must get the executor's weights.
    """
    register_attention()
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )
    return model


def own_weights(model: torch.nn.Module) -> None:
    """Copy every parameter into the process's own memory.

    transformers leaves CPU weights as views of the checkpoint's memory map: clean file pages,
    which the kernel drops whenever another process needs memory, so the next step reads the
    weights from disk again (a 121-token prefill step: 420-471 ms against 123-136 with the
    pages dropped on purpose, executor_svc/README.md). Anonymous memory stays (or, with swap,
    is swapped as any process's is).
    """
    with torch.no_grad():
        for param in model.parameters():  # tied weights are one Parameter: copied once
            param.data = param.data.clone()


def load_model(
    path: str,
    load_format: str,
    dtype_flag: str,
    device_flag: str,
    seed: int,
    fused_layers: bool = True,  # False: transformers' own modules (a reference model)
    lora: LoraSpec | None = None,  # LoRA slots (None: off)
) -> LoadedModel:
    directory = Path(path)
    device = torch.device(device_flag)
    dtype = resolve_dtype(dtype_flag, device)
    try:
        library = matmul_library()
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    register_attention()
    if not (directory / "config.json").is_file():
        raise ModelLoadError(
            f"no config.json in {directory}: point --model at a model directory (config.json, "
            "safetensors weights, tokenizer), e.g. the embedded models/smollm2-135m-instruct"
        )
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read a transformers config in {directory}: {exc}") from exc
    _check_architecture(config)
    found = ModelDir.inspect(directory)
    weights_source = choose_weights(found, load_format)
    model: Any  # transformers' typed `to` wrapper trips mypy below
    if weights_source == "dummy":
        model = dummy_model(config, dtype, seed)
        weights = f"dummy:seed={seed}"
    else:
        weights = _weights_identity(found.weight_files)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                directory, dtype=dtype, attn_implementation=ATTENTION_NAME, local_files_only=True
            )
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load the weights in {directory}: {exc}") from exc
    model = model.to(device).eval()
    model.requires_grad_(False)
    if device.type == "cpu" and weights_source != "dummy":
        own_weights(model)
    fused = 0
    kernels = None
    if device.type == "cpu":
        speed_up_lm_head(model)  # float32
        kernels = load_cpu_kernels() if fused_layers else None  # None (logged): not built
        pack_linears(model, kernels)  # bfloat16; float32 with the kernels
    # NOTE: before fusing: the fused layers then call the wrapped projections one by one
    # instead of their concatenated or epilogue-fused copies, which know nothing of adapters.
    adapters = None if lora is None else Adapters(model, lora)
    if kernels is not None:
        fused = fuse_layers(model, kernels)
    loaded = LoadedModel(
        model=model,
        config=model.config,
        name=directory.resolve().name,
        fingerprint=fingerprint(config, weights, dtype),
        dtype=dtype,
        device=device,
        eos_token_ids=_eos_ids(directory, config),
        adapters=adapters,
        layer_loop=LayerLoop.of(model, kernels) if fused else None,
    )
    log.info(
        "model_loaded",
        model=loaded.name,
        load_format=load_format,
        weights=weights_source,
        dtype=dtype_name(dtype),
        device=str(device),
        matmul_library=library if device.type == "cpu" else None,
        num_params=sum(p.numel() for p in model.parameters()),
        fused_modules=fused,
        layer_loop=loaded.layer_loop is not None,
        fingerprint=loaded.fingerprint[:16],
    )
    return loaded
