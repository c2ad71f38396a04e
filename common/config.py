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
    """Add `flag`; its default comes from the environment variable when that is set. A bad
    environment value is the same usage error (exit 2, naming the variable) as a bad flag."""
    name = env_name(flag)
    if name in os.environ:
        raw = os.environ[name]
        try:
            kwargs["default"] = _from_env(raw, kwargs)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"environment variable {name}={raw!r}: {exc}")
    help_text = kwargs.pop("help", "")
    kwargs["help"] = f"{help_text} [env {name}; default %(default)s]"
    parser.add_argument(flag, **kwargs)


def _from_env(raw: str, kwargs: dict[str, Any]) -> Any:
    if kwargs.get("action") == "store_true":
        return parse_bool(raw)
    value = kwargs.get("type", str)(raw)
    choices = kwargs.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"expected one of {', '.join(map(str, choices))}")
    return value
