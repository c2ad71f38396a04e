"""Executor settings: one frozen object from flags and PAGEDKV_* environment variables.

Validated at start with messages that say how to fix the value; passed explicitly.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from common.config import add_flag, parse_bool
from common.credentials import (
    AUTH_FLAG_NAMES,
    CredentialsError,
    InternalAuth,
    add_internal_auth_flags,
    internal_auth_from_args,
)
from common.metrics import MetricsEndpoint, add_metrics_flags, metrics_endpoint
from common.model_dirs import DEFAULT_MODEL as EMBEDDED_MODEL
from common.model_dirs import missing_model_message
from executor_svc.host_memory import available_host_bytes

DEFAULT_PORT = 50053
# Executors on one host each need their own (the launcher passes them); the default is
# given up with a warning when taken (common.metrics).
DEFAULT_METRICS_PORT = 9093
BACKENDS = ("auto", "cpu", "torch", "flashinfer")
# Which work a gateway gives an executor (Describe's role): prompts, decodes, or both.
ROLES = ("prefill", "decode", "both")
DEFAULT_MODEL = str(EMBEDDED_MODEL)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


class SettingsError(ValueError):
    """A flag or environment value that cannot work; the message says how to fix it."""


def parse_bytes(text: str) -> int:
    """'268435456', '256MiB', '1.5G' -> bytes (binary units)."""
    match = _SIZE.match(str(text))
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 268435456 or 256MiB")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "")[:1].lower()])


@dataclass(frozen=True, slots=True)
class ExecutorSettings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    pool_name: str = ""  # Describe's stable pool name ("": callers use the address)
    role: str = "both"  # Describe's role: prefill, decode or both (KV hand-off between them)
    port_file: str | None = None  # the bound port is written here once serving (port 0)
    model: str = DEFAULT_MODEL
    # auto: the directory's safetensors (a config-only preset: dummy, with a WARNING);
    # dummy: seeded random weights on purpose
    load_format: str = "auto"
    seed: int = 0
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "cpu"
    backend: str = "auto"  # cpu (C++ decode kernel) on CPU where it builds, else torch
    block_size: int = 16
    # Bytes of KV blocks on CPU: 2 GiB holds ~45k tokens of SmolLM2-135M (fp32), what 64
    # concurrent chats need; never more blocks than max_num_seqs full-length sequences use.
    kv_cache_memory: int = 2 * 2**30
    num_blocks: int | None = None  # overrides the budget (tests, debugging)
    gpu_memory_utilization: float = 0.9
    swap_space: float = 0.25  # GiB of CPU blocks for swap-out
    # GiB of CPU blocks for the prefix cache's CPU tier: cached blocks evicted from the device
    # are kept there and copied back on a hit (0: off).
    cpu_cache_space: float = 0.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # Who may call it (flags: common.auth); in-process use (tests) needs none.
    auth: InternalAuth = InternalAuth()
    # Under mutual TLS, the certificate names (roles) allowed to run steps (Execute, Release),
    # and the ones that may also Describe it; empty: any certificate of the CA.
    tls_gateway_names: str = "gateway"
    tls_allocator_names: str = "allocator"
    tune_malloc: bool = True  # CPU, glibc: a step's large tensors reuse memory (malloc_tuning.py)
    idle_release_s: float = 600.0  # a request no step used this long is dropped (0: never)
    log_json: bool = False
    log_level: str = "info"
    metrics: MetricsEndpoint = MetricsEndpoint(DEFAULT_METRICS_PORT, required=False)

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def validate(self) -> ExecutorSettings:
        """Raise SettingsError naming the flag and a working value; return self."""
        checks: list[tuple[bool, str]] = [
            (0 <= self.port < 65536, "--port must be in [0, 65535] (0 picks a free port)"),
            (self.load_format in ("auto", "dummy"), "--load-format must be auto or dummy"),
            (
                self.dtype in ("auto", "float32", "bfloat16", "float16"),
                "--dtype must be auto, float32, bfloat16 or float16",
            ),
            (
                self.device == "cpu" or self.on_cuda,
                "--device must be cpu, cuda or cuda:N",
            ),
            (
                self.backend in BACKENDS,
                "--backend must be auto, cpu, torch or flashinfer",
            ),
            (
                not (self.backend == "cpu" and self.on_cuda),
                "--backend cpu runs on --device cpu; use auto, torch or flashinfer on CUDA",
            ),
            (
                not (self.backend == "flashinfer" and not self.on_cuda),
                "--backend flashinfer needs --device cuda; use --backend torch on CPU",
            ),
            (
                not (self.backend == "flashinfer" and self.dtype == "float32"),
                "--backend flashinfer takes --dtype bfloat16 or float16 (or auto)",
            ),
            (
                self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                "--block-size must be a power of two, e.g. 16",
            ),
            (self.kv_cache_memory > 0, "--kv-cache-memory must be positive, e.g. 256MiB"),
            (
                self.num_blocks is None or self.num_blocks > 0,
                "--num-blocks must be positive (or unset to size from the memory budget)",
            ),
            (
                0.0 < self.gpu_memory_utilization <= 1.0,
                "--gpu-memory-utilization must be in (0, 1], e.g. 0.9",
            ),
            (self.swap_space >= 0, "--swap-space must be >= 0 GiB"),
            (self.cpu_cache_space >= 0, "--cpu-cache-space must be >= 0 GiB (0: no CPU tier)"),
            host_memory_check(self.swap_space, self.cpu_cache_space),
            (self.max_num_batched_tokens > 0, "--max-num-batched-tokens must be positive"),
            (self.max_num_seqs > 0, "--max-num-seqs must be positive"),
            (self.idle_release_s >= 0, "--idle-release-s must be >= 0 (0: never)"),
            pool_name_check(self.pool_name),
            role_check(self.role),
            (
                self.max_model_len is None or self.max_model_len > 0,
                "--max-model-len must be positive (or unset for the model's own limit)",
            ),
            (Path(self.model).is_dir(), missing_model_message("--model", self.model)),
        ]
        problem = self.metrics.problem(self.port)
        checks.append((problem is None, problem or ""))
        for ok, message in checks:
            if not ok:
                raise SettingsError(message)
        return self


def host_memory_check(swap_space: float, cpu_cache_space: float) -> tuple[bool, str]:
    """The CPU blocks (swap space and the CPU tier) must fit the machine's available memory."""
    if cpu_cache_space <= 0 or swap_space < 0:
        return True, ""
    available = available_host_bytes()
    wanted = (swap_space + cpu_cache_space) * 2**30
    gib = available / 2**30
    return wanted <= available, (
        f"--cpu-cache-space {cpu_cache_space:g} GiB (with --swap-space {swap_space:g} GiB) is "
        f"more than this machine's {gib:.1f} GiB of available memory; lower it (0: no CPU tier)"
    )


def pool_name_check(name: str) -> tuple[bool, str]:
    """--pool-name names the pool at the allocator and in every log line: bounded ASCII."""
    ok = len(name) <= 256 and (not name or (name.isascii() and name.isprintable()))
    return ok, "--pool-name must be at most 256 printable ASCII characters"


def role_check(role: str) -> tuple[bool, str]:
    return role in ROLES, f"--role must be one of {', '.join(ROLES)} (got {role!r})"


def add_role_flag(p: argparse.ArgumentParser, default: str) -> None:
    # No argparse choices: a bad value is one line naming the flag (validate), as --dtype.
    add_flag(p, "--role", default=default,
             help="which work a gateway gives this executor: prefill (prompts, then the "
             "request is handed off), decode (handed-off requests) or both")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m executor_svc",
        description="The pagedkv executor: model weights, paged KV cache, one step per Execute.",
    )
    d = ExecutorSettings()
    add_flag(p, "--host", default=d.host, help="interface to bind")
    add_flag(p, "--port", type=int, default=d.port, help="port to bind; 0 picks a free one")
    add_flag(p, "--port-file", default=None, help="write the bound port here once serving")
    add_flag(p, "--pool-name", default=d.pool_name,
             help="a stable name for this executor's KV pool at the allocator (a StatefulSet "
             "pod's name), reported by Describe; empty: callers use the address")
    add_role_flag(p, d.role)
    add_metrics_flags(p, DEFAULT_METRICS_PORT)
    add_flag(p, "--model", default=d.model, help="model directory (config.json, safetensors)")
    add_flag(p, "--load-format", default=d.load_format, choices=["auto", "dummy"], help="weights")
    add_flag(p, "--seed", type=int, default=d.seed, help="seed for dummy weights and sampling")
    add_flag(p, "--dtype", default=d.dtype, help="auto, float32, bfloat16 or float16")
    add_flag(p, "--device", default=d.device, help="cpu or cuda[:N]")
    add_flag(
        p,
        "--backend",
        default=d.backend,
        choices=list(BACKENDS),
        help="attention: auto (cpu on CPU where its kernel builds, else torch), cpu (C++ "
        "decode kernel), torch (reference: gather + SDPA) or flashinfer (CUDA)",
    )
    add_flag(p, "--block-size", type=int, default=d.block_size, help="tokens per KV block")
    add_flag(p, "--kv-cache-memory", type=parse_bytes, default=d.kv_cache_memory, help="CPU KV")
    add_flag(p, "--num-blocks", type=int, default=None, help="fixed number of KV blocks")
    add_flag(
        p,
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="fraction of GPU memory for weights, activations and KV",
    )
    add_flag(p, "--swap-space", type=float, default=d.swap_space, help="GiB of CPU swap blocks")
    add_flag(p, "--cpu-cache-space", type=float, default=d.cpu_cache_space,
             help="GiB of CPU blocks for the prefix cache's CPU tier: cached blocks evicted "
             "from the device are kept there and copied back on a hit (0: off)")
    add_flag(
        p, "--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="per step"
    )
    add_flag(p, "--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences per step")
    add_flag(p, "--max-model-len", type=int, default=None, help="longest sequence in tokens")
    add_flag(
        p,
        "--tune-malloc",
        type=parse_bool,
        default=d.tune_malloc,
        help="CPU executors on glibc: one malloc arena, no mmap'ed chunks, freed memory kept, "
        "so that a step's large tensors reuse memory (true/false)",
    )
    add_flag(
        p, "--idle-release-s", type=float, default=d.idle_release_s,
        help="drop a request's state when no step has used it for this long (its caller died "
        "without releasing it); 0: never",
    )
    add_flag(p, "--log-json", action="store_true", default=False, help="JSON logs")
    add_flag(p, "--log-level", default=d.log_level, help="debug, info, warning, error")
    add_internal_auth_flags(p)
    add_flag(p, "--tls-gateway-names", default=d.tls_gateway_names,
             help="with mutual TLS: comma-separated certificate names (subject CN) that may "
             "call Execute and Release (empty: any certificate of the CA)")
    add_flag(p, "--tls-allocator-names", default=d.tls_allocator_names,
             help="with mutual TLS: certificate names that may call Describe besides those "
             "(the allocator confirms a pool reset with it)")
    return p


def parse_settings(argv: Sequence[str] | None = None) -> ExecutorSettings:
    return settings_from_args(ExecutorSettings, build_parser().parse_args(argv))


S = TypeVar("S")


def settings_from_args(cls: Callable[..., S], args: argparse.Namespace) -> S:
    """The parsed flags as `cls` (either executor's settings): the credential and metrics
    flags become its `auth` and `metrics`; the rest are its fields by name."""
    try:
        auth = internal_auth_from_args(args)
    except CredentialsError as exc:
        raise SettingsError(str(exc)) from exc
    metrics = metrics_endpoint(args)
    values = vars(args)
    for name in (*AUTH_FLAG_NAMES, "metrics_port", "metrics_port_file"):
        del values[name]
    values.pop("metrics_port_set", None)
    return cls(**values, auth=auth, metrics=metrics).validate()  # type: ignore[attr-defined]
