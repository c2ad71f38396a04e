"""Build the model presets in this directory, offline and deterministically.

    .venv/bin/python models/build_presets.py

Each preset is a directory that transformers loads with no network: `config.json` (weights are
random, `--load-format dummy`, seeded) and a byte-level BPE tokenizer (`tokenizer.json` +
`tokenizer_config.json`) trained here on `tokenizer_corpus.txt` (the project's design notes).

NOTE: the corpus is small, so BPE training stops at a few thousand merges. The tokenizer vocab is
then padded with `<|reserved_N|>` tokens (plain vocab entries without merges, as Llama 3 does
with its reserved tokens) up to the model's `vocab_size`, so every id the model can sample
decodes. This keeps a 32,000-entry tokenizer under 1 MB. `llama3-8b-shapes` is config only (its
128,256-entry vocab would need a ~3 MB file and it only serves GPU kernel benchmarks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "tokenizer_corpus.txt"
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
MAX_MERGE_VOCAB = 4096  # the most ids that BPE training may produce before padding


@dataclass(frozen=True)
class Preset:
    name: str
    config: dict[str, Any]
    with_tokenizer: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def _llama_like(model_type: str, arch: str, **shape: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    config.update(shape)
    return config


PRESETS = [
    # Tests: seconds on CPU. Different head dims and GQA ratios across the three families.
    Preset(
        "tiny-llama",
        _llama_like(
            "llama",
            "LlamaForCausalLM",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
            max_position_embeddings=2048,
        ),
    ),
    Preset(
        "tiny-qwen2",  # qkv bias, head_dim 24, GQA 4:1
        _llama_like(
            "qwen2",
            "Qwen2ForCausalLM",
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            vocab_size=640,
            max_position_embeddings=2048,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=2,
        ),
    ),
    Preset(
        "tiny-mistral",  # head_dim 32, GQA 2:1, no sliding window (paged path has none)
        _llama_like(
            "mistral",
            "MistralForCausalLM",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=768,
            max_position_embeddings=2048,
            sliding_window=None,
        ),
    ),
    # GPU tests: FlashInfer's kernels take head dims 64/128/256 (the GPU bundle: 128, bf16).
    Preset(
        "tiny-llama-hd128",
        _llama_like(
            "llama",
            "LlamaForCausalLM",
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=128,
            vocab_size=512,
            max_position_embeddings=2048,
        ),
    ),
    # CPU benchmarks (BENCHMARKS.md): hidden 256, 4 layers, 8 heads, 2 KV heads, vocab 32,000.
    Preset(
        "small-llama",
        _llama_like(
            "llama",
            "LlamaForCausalLM",
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
    ),
    # GPU benchmarks: the shapes of Llama-3-8B (config only, bf16).
    Preset(
        "llama3-8b-shapes",
        {
            **_llama_like(
                "llama",
                "LlamaForCausalLM",
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=128256,
                max_position_embeddings=8192,
                rope_theta=500000.0,
                rms_norm_eps=1e-5,
            ),
            "torch_dtype": "bfloat16",
        },
        with_tokenizer=False,
    ),
]


def _train_bpe(target: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS)], trainer)
    return tokenizer


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE on the corpus, padded with reserved tokens to exactly `vocab_size` ids."""
    target = min(vocab_size, MAX_MERGE_VOCAB)
    while True:  # the trainer may overshoot its target by a token or two
        tokenizer = _train_bpe(target)
        overshoot = tokenizer.get_vocab_size() - vocab_size
        if overshoot <= 0:
            break
        target -= overshoot
    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    next_id = len(vocab)
    while next_id < vocab_size:
        vocab[f"<|reserved_{next_id}|>"] = next_id
        next_id += 1
    assert len(vocab) == vocab_size, f"tokenizer has {len(vocab)} ids, model {vocab_size}"
    tokenizer = Tokenizer.from_str(json.dumps(data))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tokenizer


def tokenizer_config(max_len: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "unk_token": None,
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build(preset: Preset) -> None:
    out = HERE / preset.name
    out.mkdir(exist_ok=True)
    write_json(out / "config.json", preset.config)
    write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID},
    )
    if not preset.with_tokenizer:
        return
    tokenizer = train_tokenizer(int(preset.config["vocab_size"]))
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(
        out / "tokenizer_config.json",
        tokenizer_config(int(preset.config["max_position_embeddings"])),
    )


def main() -> None:
    for preset in PRESETS:
        build(preset)


if __name__ == "__main__":
    main()
