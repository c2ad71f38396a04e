"""FLAGS.md, written from the services' own parsers: every flag, its environment variable,
its default and its check, as declared once in each service's settings (common/config.py).

    python -m tools.flags_doc          # rewrite FLAGS.md
    python -m tools.flags_doc --check  # exit 1 when FLAGS.md is out of date (make lint)
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from pathlib import Path
from unittest import mock

from common.config import declared_check, env_name

ROOT = Path(__file__).resolve().parent.parent
FLAGS_MD = ROOT / "FLAGS.md"
# (title, module whose build_parser() makes the parser, what it is)
SECTIONS = (
    ("Gateway", "gateway.settings", "`python -m gateway`: the public APIs, tokenizer and "
     "scheduler."),
    ("Allocator", "allocator_svc.settings", "`python -m allocator_svc`: the block allocator."),
    ("Executor", "executor_svc.settings", "`python -m executor_svc`: the model and its KV "
     "cache."),
    ("Simulated executor", "executor_svc.simulated.settings", "`python -m "
     "executor_svc.simulated`: the executor contract without a model "
     "([executor_svc/simulated](executor_svc/simulated/README.md))."),
    ("Launcher", "tools.launch", "`python -m tools.launch`: the whole stack on one machine; "
     "any flag not listed here goes to every service whose parser takes it, checked there."),
)
_SUFFIX = re.compile(r"\s*\[env [A-Z0-9_]+; default .*\]$", re.S)


def render() -> str:
    lines = [
        "# Flags",
        "",
        "<!-- Written by `python -m tools.flags_doc` from the services' parsers; edit the "
        "settings, not this file. -->",
        "",
        "Every flag has an environment variable (`--block-size` is `PAGEDKV_BLOCK_SIZE`); the "
        "flag wins over it. A value that cannot work stops the service at start with exit "
        "status 2, naming the flag (or the variable) and what it must be: in one line, after "
        "the usage when argparse cannot read the value at all.",
    ]
    for title, module, what in SECTIONS:
        parser = _parser(module)
        lines += ["", f"## {title}", "", what, "",
                  "| flag | environment | default | must be | what |", "|---|---|---|---|---|"]
        lines += [_row(action) for action in parser._actions if action.option_strings
                  and action.dest != "help"]
    return "\n".join(lines) + "\n"


def _parser(module: str) -> argparse.ArgumentParser:
    """The module's parser with its built-in defaults (no PAGEDKV_* variable of this shell)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_")}
    with mock.patch.dict(os.environ, clean, clear=True):
        return importlib.import_module(module).build_parser()  # type: ignore[no-any-return]


def _row(action: argparse.Action) -> str:
    flag = max(action.option_strings, key=len)
    what = _SUFFIX.sub("", action.help or "")
    must = declared_check(action) or ""
    if action.choices is not None:  # argparse's own choices, listed with the flag
        flag += " {" + ",".join(map(str, action.choices)) + "}"
        must = ""
    elif str(action.metavar).startswith("{"):  # a declared setting's (common/config.py)
        flag += f" {action.metavar}"
        must = ""
    return (f"| `{flag}` | `{env_name(flag.split()[0])}` | {_default(action)} | {_cell(must)} "
            f"| {_cell(what)} |")


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value == "":
        return "unset"
    if isinstance(value, (tuple, frozenset)):
        value = ",".join(sorted(value) if isinstance(value, frozenset) else value)
    text = str(value).replace(str(ROOT) + "/", "")  # the checkout's models, where it is
    return f"`{text}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.flags_doc", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only check FLAGS.md is current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if FLAGS_MD.read_text() != text:
            print("FLAGS.md is out of date: run `python -m tools.flags_doc`", file=sys.stderr)
            return 1
        return 0
    FLAGS_MD.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
