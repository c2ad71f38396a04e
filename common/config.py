"""Settings declared once: a dataclass field's metadata gives its flag (`--block-size`), its
environment variable (`PAGEDKV_BLOCK_SIZE`), its default and its check.

A service declares its settings as one frozen dataclass of `setting(...)` fields; the parser,
the help, the environment and the validation all come from those fields, so adding a setting
is one declaration.
"""

from __future__ import annotations

import argparse
import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

_SETTING = "pagedkv.setting"


class SettingsError(ValueError):
    """A flag or environment value that cannot work; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class _Declared:
    help: str
    type: Callable[[str], Any] | None
    choices: tuple[Any, ...] | None
    check: Callable[[Any], bool] | None
    must: str
    flag: str | None
    metavar: str | None


def setting(
    default: Any,
    help: str,
    *,
    type: Callable[[str], Any] | None = None,
    choices: Sequence[Any] | None = None,
    check: Callable[[Any], bool] | None = None,
    must: str = "",
    flag: str | None = None,
    metavar: str | None = None,
) -> Any:
    """A settings field. `check(value)` false (None, "unset", is never checked) stops the
    service with "--flag must be <must>". The flag is the field's name with dashes unless
    `flag` names it; `type` parses its text (by default the default's type; a bool defaulting
    to False is a bare switch, one defaulting to True takes true/false)."""
    if choices is not None:
        assert check is None, "choices are the check"
        options = tuple(choices)
        check = options.__contains__
        must = must or f"one of {', '.join(map(str, options))}"
        choices = options
    assert (check is None) == (not must), "a check says what the value must be"
    declared = _Declared(help, type, choices, check, must, flag, metavar)  # type: ignore[arg-type]
    return field(default=default, metadata={_SETTING: declared})


def flag_of(name: str, declared: _Declared) -> str:
    return declared.flag or "--" + name.replace("_", "-")


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


def add_settings(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per declared field of `cls`, in declaration order."""
    for f in fields(cls):
        declared = f.metadata.get(_SETTING)
        if declared is None:
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": declared.help}
        if isinstance(f.default, bool) and declared.type is None:
            if f.default:
                kwargs["type"] = parse_bool
            else:
                kwargs["action"] = "store_true"
        else:
            default_type = str if f.default is None else type(f.default)
            kwargs["type"] = declared.type or default_type
        if declared.metavar is not None:
            kwargs["metavar"] = declared.metavar
        elif declared.choices is not None:  # listed in --help; checked with the others
            kwargs["metavar"] = "{" + ",".join(map(str, declared.choices)) + "}"
        if declared.check is not None:
            kwargs["check"] = (declared.check, declared.must)
        add_flag(parser, flag_of(f.name, declared), **kwargs)


def declared_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags of `cls`'s declared fields, by field name."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if _SETTING in f.metadata}


def load(cls: Callable[..., Any], parser: argparse.ArgumentParser,
         argv: Sequence[str] | None, derive: Callable[[argparse.Namespace], dict[str, Any]]) -> Any:
    """Parse `argv` into `cls`: its declared fields from their flags, the rest from `derive`
    (credentials, metrics). A value that cannot work stops the process with exit status 2 and
    one line naming its flag (a flag argparse cannot parse prints the usage too)."""
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(given)
    _check_environment(parser, args, given)
    try:
        return cls(**declared_values(cls, args), **derive(args))  # type: ignore[arg-type]
    except SettingsError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def _check_environment(parser: argparse.ArgumentParser, args: argparse.Namespace,
                       argv: list[str]) -> None:
    """A declared check fails on a value that came from the environment (its flag was not
    given): a usage error naming the variable. (A flag given wins: its variable is ignored.)"""
    for action in parser._actions:
        source = _FROM_ENV.get(action)
        if source is None or any(token == flag or token.startswith(flag + "=")
                                 for token in argv for flag in action.option_strings):
            continue
        problem = flag_problem(action, getattr(args, action.dest))
        if problem is not None:
            name, raw = source
            parser.error(f"environment variable {name}={raw!r}: must be "
                         f"{declared_check(action)}")


def check_settings(settings: Any) -> None:
    """Raise SettingsError for the first declared field whose value fails its check."""
    for f in fields(settings):
        declared = f.metadata.get(_SETTING)
        value = getattr(settings, f.name)
        if declared is None or declared.check is None or value is None:
            continue
        if not declared.check(value):
            raise SettingsError(f"{flag_of(f.name, declared)} must be {declared.must}, "
                                f"not {value!r}")


def add_flag(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """Add `flag`; its default comes from the environment variable when that is set. An
    environment value that does not parse is the same usage error (exit 2, naming the
    variable) as a bad flag; `check` (a check and what it wants) is applied by `load`."""
    name = env_name(flag)
    check = kwargs.pop("check", None)
    raw = os.environ.get(name)
    if raw is not None:
        try:
            kwargs["default"] = _from_env(raw, kwargs)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"environment variable {name}={raw!r}: {exc}")
    help_text = kwargs.pop("help", "")
    default = kwargs.get("default")
    shown = "%(default)s"
    if isinstance(default, (tuple, frozenset)):  # a comma-separated list
        shown = ",".join(sorted(map(str, default)) if isinstance(default, frozenset) else default)
    kwargs["help"] = f"{help_text} [env {name}; default {shown}]"
    action = parser.add_argument(flag, **kwargs)
    if check is not None:
        _CHECKS[action] = check
    if raw is not None:
        _FROM_ENV[action] = (name, raw)


# Each declared flag's check (for `load` and for callers that parse a flag alone: the
# launcher), and the variable its default came from.
_CHECKS: weakref.WeakKeyDictionary[argparse.Action, tuple[Callable[[Any], bool], str]] = (
    weakref.WeakKeyDictionary())
_FROM_ENV: weakref.WeakKeyDictionary[argparse.Action, tuple[str, str]] = (
    weakref.WeakKeyDictionary())


def declared_check(action: argparse.Action) -> str | None:
    """What the flag of `action` must be, by its declared check (None: unchecked)."""
    check = _CHECKS.get(action)
    return None if check is None else check[1]


def flag_problem(action: argparse.Action, value: Any) -> str | None:
    """What is wrong with `value` for the flag of `action` by its declared check, or None."""
    check = _CHECKS.get(action)
    if check is None or value is None or check[0](value):
        return None
    return f"{action.option_strings[0]} must be {check[1]}, not {value!r}"


def _from_env(raw: str, kwargs: Mapping[str, Any]) -> Any:
    if kwargs.get("action") == "store_true":
        return parse_bool(raw)
    value = kwargs.get("type", str)(raw)
    choices = kwargs.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"expected one of {', '.join(map(str, choices))}")
    return value


def split_names(value: str) -> frozenset[str]:
    """A comma-separated list of names, as a set (empty entries dropped)."""
    return frozenset(n.strip() for n in value.split(",") if n.strip())


# Checks that read as what they say.
def at_least(low: float) -> Callable[[Any], bool]:
    return lambda value: value >= low


def positive(value: float) -> bool:
    return value > 0


def finite_at_least(low: float) -> Callable[[float], bool]:
    return lambda value: low <= value < float("inf")


def within(low: float, high: float) -> Callable[[float], bool]:
    """low <= value <= high (NaN fails)."""
    return lambda value: low <= value <= high


def power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def is_port(value: int) -> bool:
    return 0 <= value <= 65535
