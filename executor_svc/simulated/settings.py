"""Simulated executor settings: the real executor's serving settings (host, ports,
credentials, metrics, limits) and what the simulation adds, each declared once.

The model directory gives only what Describe reports of the model (vocabulary, EOS ids,
maximum length: its config, no weights); `--simulate-profile` gives step times and the KV
capacity.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from common.config import add_settings, at_least, load, positive, setting
from common.credentials import add_internal_auth_flags
from common.metrics import add_metrics_flags
from executor_svc.settings import (
    DEFAULT_METRICS_PORT,
    DEFAULT_MODEL,
    ServingSettings,
    serving_flags,
)
from executor_svc.simulated.profiles import DEFAULT_PROFILE, PROFILES


@dataclass(frozen=True, slots=True)
class SimulatedSettings(ServingSettings):
    model: str = setting(
        DEFAULT_MODEL, "model directory whose config.json gives vocabulary, EOS ids and "
        "length (the gateway's tokenizer should match it); no weights are read")
    num_blocks: int | None = setting(
        None, "KV blocks (unset: the profile's capacity)", type=int, check=positive,
        must="positive (or unset for the profile's KV capacity)")
    simulate_profile: str = setting(
        DEFAULT_PROFILE, "step-time model and KV capacity (executor_svc/simulated/profiles.py)",
        choices=tuple(PROFILES))
    time_scale: float = setting(1.0, "multiply modelled step times (0: answer at once)",
                                check=at_least(0), must=">= 0 (1: modelled times; 0: none)")
    num_cpu_blocks: int | None = setting(
        None, "host blocks for swap (unset: the profile's 4 GiB)", type=int,
        check=at_least(0), must=">= 0")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m executor_svc.simulated",
        description="A simulated pagedkv executor: the executor contract without a model; "
        "step times from a published GPU profile, tokens from a hash of the context.",
    )
    add_settings(parser, SimulatedSettings)
    add_metrics_flags(parser, DEFAULT_METRICS_PORT)
    add_internal_auth_flags(parser)
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> SimulatedSettings:
    """The settings from `argv` (else sys.argv) and the environment; a value that cannot work
    is a usage error (exit 2) naming its flag."""
    return load(SimulatedSettings, build_parser(), argv, serving_flags)  # type: ignore[no-any-return]
