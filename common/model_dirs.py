"""Where models live: the shipped presets, the embedded default, and what a directory holds.

The repository's `models/` folder holds config-only presets (tiny random models for tests and
benchmarks) and, once `make setup` has run, the embedded real model. Every service defaults
to that real model; the presets are picked by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PRESETS_DIR = REPO_ROOT / "models"
DEFAULT_MODEL = PRESETS_DIR / "smollm2-135m-instruct"  # built by `make setup`

WEIGHT_SUFFIXES = (".safetensors",)
FOREIGN_SUFFIXES = {  # checkpoints we recognise but do not load, with the remedy
    ".gguf": "a GGUF checkpoint: convert it to safetensors first (transformers "
    "from_pretrained(dir, gguf_file=...) then save_pretrained; models/fetch_smollm2.py does it)",
    ".bin": "a pickled PyTorch checkpoint: only safetensors are loaded (pickles can run "
    "code); convert it with save_pretrained(dir, safe_serialization=True)",
    ".pt": "a pickled PyTorch checkpoint: only safetensors are loaded; convert it with "
    "save_pretrained(dir, safe_serialization=True)",
    ".pth": "a pickled PyTorch checkpoint: only safetensors are loaded; convert it with "
    "save_pretrained(dir, safe_serialization=True)",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True, slots=True)
class ModelDir:
    """What one model directory holds, read without loading anything."""

    path: Path
    weight_files: tuple[Path, ...]
    foreign_files: tuple[Path, ...]  # checkpoints in a format we do not load
    has_tokenizer: bool

    @classmethod
    def inspect(cls, path: str | Path) -> ModelDir:
        directory = Path(path)
        files = sorted(p for p in directory.iterdir() if p.is_file())
        return cls(
            path=directory,
            weight_files=tuple(p for p in files if p.suffix in WEIGHT_SUFFIXES),
            foreign_files=tuple(p for p in files if p.suffix in FOREIGN_SUFFIXES),
            has_tokenizer=any((directory / name).is_file() for name in TOKENIZER_FILES),
        )

    @property
    def is_preset(self) -> bool:
        """A config-only preset shipped in the repository (random weights by design)."""
        return self.path.resolve().parent == PRESETS_DIR and not self.weight_files


def model_name(path: str | Path) -> str:
    """The name a model is served under by default: its config's own name (`_name_or_path`,
    e.g. `Qwen/Qwen2.5-0.5B-Instruct`) when that is a name, not a path; else the directory's."""
    directory = Path(path)
    try:
        name = json.loads((directory / "config.json").read_text()).get("_name_or_path", "")
    except (OSError, ValueError, AttributeError):
        name = ""
    if isinstance(name, str) and name and not name.startswith(("/", ".", "~")):
        return name.rstrip("/")
    return directory.resolve().name


def missing_model_message(flag: str, path: str | Path) -> str:
    """Why `path` is not a model directory, and what to do about it."""
    if Path(path).resolve() == DEFAULT_MODEL:
        return (
            f"{flag} {path}: the embedded model is not built yet; run `make setup` "
            "(it converts SmolLM2-135M-Instruct once, offline afterwards)"
        )
    return f"{flag} {str(path)!r} is not a directory; give a model directory (config.json, ...)"
