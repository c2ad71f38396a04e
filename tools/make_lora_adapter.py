"""Write a PEFT LoRA adapter of seeded random weights for a model directory: LoRA serving
tried without a trained adapter (the tests and bench.lora use it). Needs peft (make setup's
dev extra). The adapter depends only on the model's config: its weights are never read.

    python -m tools.make_lora_adapter models/smollm2-135m-instruct /tmp/adapters/a --rank 8
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model_dir: str | Path, out_dir: str | Path, *, rank: int = 8,
                 alpha: int | None = None, seed: int = 0,
                 targets: Sequence[str] = ALL_TARGETS) -> Path:
    """PEFT's own save of a LoraConfig(rank, alpha (default: rank), targets) whose A and B
    are both drawn (init_lora_weights=False: B is not zero, so the adapter changes outputs)."""
    from peft import LoraConfig, get_peft_model  # a dev dependency: imported when used

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu")
    model.config.name_or_path = str(model_dir)
    torch.manual_seed(seed)
    lora = LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=list(targets),
                      init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    out = Path(out_dir)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.make_lora_adapter",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=int, default=None, help="default: the rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", default=",".join(ALL_TARGETS),
                        help="comma-separated module names")
    args = parser.parse_args(argv)
    out = make_adapter(args.model_dir, args.out_dir, rank=args.rank, alpha=args.alpha,
                       seed=args.seed, targets=args.targets.split(","))
    print(out)  # noqa: T201 - the path, for scripts
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
