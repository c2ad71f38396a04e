"""Flags with environment-variable equivalents: `--block-size` <-> `PAGEDKV_BLOCK_SIZE`."""

from __future__ import annotations

import argparse
import os
from typing import Any


def env_name(flag: str) -> str:
    return "PAGEDKV_" + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(raw: str) -> bool:
    """A boolean flag's value: true/false, 1/0, yes/no, on/off (any case)."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {raw!r}")


def add_flag(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """Add `flag`; its default comes from the environment variable when that is set."""
    name = env_name(flag)
    if name in os.environ:
        raw = os.environ[name]
        kind = kwargs.get("type", str)
        if kwargs.get("action") == "store_true":
            kwargs["default"] = raw.lower() in ("1", "true", "yes", "on")
        else:
            kwargs["default"] = kind(raw)
    help_text = kwargs.pop("help", "")
    kwargs["help"] = f"{help_text} [env {name}; default %(default)s]"
    parser.add_argument(flag, **kwargs)
