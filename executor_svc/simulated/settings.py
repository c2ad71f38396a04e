"""Simulated executor settings: one frozen object from flags and PAGEDKV_* variables.

The serving flags are the real executor's (host, ports, credentials, metrics, limits); the
model directory gives only what Describe reports of the model (vocabulary, EOS ids, maximum
length: its config, no weights); `--simulate-profile` gives step times and the KV capacity.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from common.config import add_flag
from common.credentials import (
    InternalAuth,
    add_internal_auth_flags,
)
from common.metrics import MetricsEndpoint, add_metrics_flags
from executor_svc.settings import (
    DEFAULT_METRICS_PORT,
    DEFAULT_MODEL,
    DEFAULT_PORT,
    SettingsError,
    add_role_flag,
    pool_name_check,
    role_check,
    settings_from_args,
)
from executor_svc.simulated.profiles import DEFAULT_PROFILE, PROFILES


@dataclass(frozen=True, slots=True)
class SimulatedSettings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    port_file: str | None = None
    pool_name: str = ""
    role: str = "both"  # Describe's role: prefill, decode or both
    model: str = DEFAULT_MODEL  # config.json (+ generation_config.json) only
    simulate_profile: str = DEFAULT_PROFILE
    time_scale: float = 1.0  # modelled step times x this; 0: no sleeping (tests)
    block_size: int = 16
    num_blocks: int | None = None  # None: the profile's KV capacity
    num_cpu_blocks: int | None = None  # None: the profile's 4 GiB of swap
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's
    idle_release_s: float = 600.0
    auth: InternalAuth = InternalAuth()
    tls_gateway_names: str = "gateway"
    tls_allocator_names: str = "allocator"
    log_json: bool = False
    log_level: str = "info"
    metrics: MetricsEndpoint = MetricsEndpoint(DEFAULT_METRICS_PORT, required=False)

    def validate(self) -> SimulatedSettings:
        """Raise SettingsError naming the flag and a working value; return self."""
        checks: list[tuple[bool, str]] = [
            (0 <= self.port < 65536, "--port must be in [0, 65535] (0 picks a free port)"),
            (self.simulate_profile in PROFILES,
             f"--simulate-profile must be one of {', '.join(PROFILES)}"),
            (self.time_scale >= 0, "--time-scale must be >= 0 (1: modelled times; 0: none)"),
            (self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
             "--block-size must be a power of two, e.g. 16"),
            (self.num_blocks is None or self.num_blocks > 0,
             "--num-blocks must be positive (or unset for the profile's KV capacity)"),
            (self.num_cpu_blocks is None or self.num_cpu_blocks >= 0,
             "--num-cpu-blocks must be >= 0"),
            (self.max_num_batched_tokens > 0, "--max-num-batched-tokens must be positive"),
            (self.max_num_seqs > 0, "--max-num-seqs must be positive"),
            (self.max_model_len is None or self.max_model_len > 0,
             "--max-model-len must be positive (or unset for the model's own limit)"),
            (self.idle_release_s >= 0, "--idle-release-s must be >= 0 (0: never)"),
            pool_name_check(self.pool_name),
            role_check(self.role),
        ]
        problem = self.metrics.problem(self.port)
        checks.append((problem is None, problem or ""))
        for ok, message in checks:
            if not ok:
                raise SettingsError(message)
        return self


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m executor_svc.simulated",
        description="A simulated pagedkv executor: the executor contract without a model; "
        "step times from a published GPU profile, tokens from a hash of the context.",
    )
    d = SimulatedSettings()
    add_flag(p, "--host", default=d.host, help="interface to bind")
    add_flag(p, "--port", type=int, default=d.port, help="port to bind; 0 picks a free one")
    add_flag(p, "--port-file", default=None, help="write the bound port here once serving")
    add_flag(p, "--pool-name", default=d.pool_name,
             help="a stable name for this executor's KV pool, reported by Describe")
    add_role_flag(p, d.role)
    add_metrics_flags(p, DEFAULT_METRICS_PORT)
    add_flag(p, "--model", default=d.model,
             help="model directory whose config.json gives vocabulary, EOS ids and length "
             "(the gateway's tokenizer should match it); no weights are read")
    add_flag(p, "--simulate-profile", default=d.simulate_profile, choices=list(PROFILES),
             help="step-time model and KV capacity (executor_svc/simulated/profiles.py)")
    add_flag(p, "--time-scale", type=float, default=d.time_scale,
             help="multiply modelled step times (0: answer at once)")
    add_flag(p, "--block-size", type=int, default=d.block_size, help="tokens per KV block")
    add_flag(p, "--num-blocks", type=int, default=None,
             help="KV blocks (default: the profile's capacity)")
    add_flag(p, "--num-cpu-blocks", type=int, default=None,
             help="host blocks for swap (default: the profile's 4 GiB)")
    add_flag(p, "--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
             help="per step")
    add_flag(p, "--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences per step")
    add_flag(p, "--max-model-len", type=int, default=None, help="longest sequence in tokens")
    add_flag(p, "--idle-release-s", type=float, default=d.idle_release_s,
             help="drop a request no step has used for this long; 0: never")
    add_flag(p, "--log-json", action="store_true", default=False, help="JSON logs")
    add_flag(p, "--log-level", default=d.log_level, help="debug, info, warning, error")
    add_internal_auth_flags(p)
    add_flag(p, "--tls-gateway-names", default=d.tls_gateway_names,
             help="with mutual TLS: certificate names that may call Execute and Release")
    add_flag(p, "--tls-allocator-names", default=d.tls_allocator_names,
             help="with mutual TLS: certificate names that may also call Describe")
    return p


def parse_settings(argv: Sequence[str] | None = None) -> SimulatedSettings:
    return settings_from_args(SimulatedSettings, build_parser().parse_args(argv))
