"""Executor settings: each declared once (common/config.py) as a flag with a PAGEDKV_*
environment equivalent, a default and a check. `ServingSettings` holds what both executors
(the real one and the simulated one) serve with; checked when made, with messages that say
how to fix the value."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import (
    SettingsError,
    add_settings,
    at_least,
    check_settings,
    is_port,
    load,
    positive,
    power_of_two,
    setting,
    split_names,
)
from common.credentials import InternalAuth, add_internal_auth_flags, internal_auth_from_args
from common.executor_description import MAX_POOL_NAME_CHARS
from common.metrics import MetricsEndpoint, add_metrics_flags, metrics_endpoint
from common.model_dirs import DEFAULT_MODEL as EMBEDDED_MODEL
from common.model_dirs import missing_model_message
from common.step_records import MAX_LOOKAHEAD_TOKENS
from executor_svc.host_memory import available_host_bytes

DEFAULT_PORT = 50053
# Executors on one host each need their own (the launcher passes them); the default is
# given up with a warning when taken (common.metrics).
DEFAULT_METRICS_PORT = 9093
BACKENDS = ("auto", "cpu", "torch", "flashinfer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Which work a gateway gives an executor (Describe's role): prompts, decodes, or both.
ROLES = ("prefill", "decode", "both")
DEFAULT_MODEL = str(EMBEDDED_MODEL)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """'268435456', '256MiB', '1.5G' -> bytes (binary units)."""
    match = _SIZE.match(str(text))
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 268435456 or 256MiB")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "")[:1].lower()])


def parse_lora_modules(text: str) -> tuple[tuple[str, str], ...]:
    """'a=/adapters/a,b=/adapters/b' -> (('a', '/adapters/a'), ('b', '/adapters/b'))."""
    modules: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise argparse.ArgumentTypeError(f"{item!r} is not NAME=DIR")
        modules.append((name.strip(), path.strip()))
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} names an adapter twice")
    return tuple(modules)


def _pool_name_ok(name: str) -> bool:
    """It names the pool at the allocator and in every log line: bounded ASCII."""
    return len(name) <= MAX_POOL_NAME_CHARS and (
        not name or (name.isascii() and name.isprintable()))


@dataclass(frozen=True, slots=True)
class ServingSettings:
    """What either executor serves with: its address, pool, limits, callers and logs."""

    host: str = setting("127.0.0.1", "interface to bind")
    port: int = setting(DEFAULT_PORT, "port to bind; 0 picks a free one", check=is_port,
                        must="in [0, 65535] (0 picks a free port)")
    port_file: str | None = setting(None, "write the bound port here once serving")
    pool_name: str = setting(
        "", "a stable name for this executor's KV pool at the allocator (a StatefulSet pod's "
        "name), reported by Describe; empty: callers use the address", check=_pool_name_ok,
        must=f"at most {MAX_POOL_NAME_CHARS} printable ASCII characters")
    role: str = setting(
        "both", "which work a gateway gives this executor: prefill (prompts, then the request "
        "is handed off), decode (handed-off requests) or both", choices=ROLES)
    model: str = setting(DEFAULT_MODEL, "model directory (config.json, safetensors)")
    block_size: int = setting(16, "tokens per KV block", check=power_of_two,
                              must="a power of two, e.g. 16")
    num_blocks: int | None = setting(
        None, "fixed number of KV blocks (unset: sized from the memory budget)", type=int,
        check=positive, must="positive (or unset to size from the memory budget)")
    max_num_batched_tokens: int = setting(2048, "tokens per step", check=positive,
                                          must="positive")
    max_num_seqs: int = setting(256, "sequences per step", check=positive, must="positive")
    max_draft_tokens: int = setting(
        4, "draft tokens a sequence may ask this executor to verify in a step (speculative "
        "decoding: a gateway's --speculative-config drafts at most this many); on a GPU the "
        "memory profile keeps room for their logits; 0: none",
        check=lambda n: 0 <= n <= MAX_LOOKAHEAD_TOKENS, must=f"in 0..{MAX_LOOKAHEAD_TOKENS}")
    max_model_len: int | None = setting(
        None, "longest sequence in tokens (unset: the model's max_position_embeddings)",
        type=int, check=positive, must="positive (or unset for the model's own limit)")
    idle_release_s: float = setting(
        600.0, "drop a request's state when no step has used it for this long (its caller "
        "died without releasing it); 0: never", check=at_least(0), must=">= 0 (0: never)")
    # Under mutual TLS, the certificate names (roles) allowed to run steps (Execute,
    # Release), and the ones that may also Describe it; empty: any certificate of the CA.
    tls_gateway_names: frozenset[str] = setting(
        frozenset({"gateway"}), "with mutual TLS: comma-separated certificate names (subject "
        "CN) that may call Execute and Release (empty: any certificate of the CA)",
        type=split_names, metavar="NAME[,...]")
    tls_allocator_names: frozenset[str] = setting(
        frozenset({"allocator"}), "with mutual TLS: certificate names that may call Describe "
        "besides those (the allocator confirms a pool reset with it)", type=split_names,
        metavar="NAME[,...]")
    log_json: bool = setting(False, "JSON logs")
    log_level: str = setting("info", "debug, info, warning, error")
    # From the credential and metrics flags; in-process use (tests) needs no credentials.
    auth: InternalAuth = InternalAuth()
    metrics: MetricsEndpoint = MetricsEndpoint(DEFAULT_METRICS_PORT, required=False)

    def __post_init__(self) -> None:
        check_settings(self)
        self.metrics.check(self.port)


@dataclass(frozen=True, slots=True)
class ExecutorSettings(ServingSettings):
    # auto: the directory's safetensors (a config-only preset: dummy, with a WARNING);
    # dummy: seeded random weights on purpose
    load_format: str = setting("auto", "weights: the directory's (auto) or seeded random "
                               "ones (dummy)", choices=("auto", "dummy"))
    seed: int = setting(0, "seed for dummy weights and sampling")
    dtype: str = setting("auto", "auto (bfloat16 on CUDA and on CPUs with bfloat16 hardware, "
                         "AVX512-BF16 or AMX; else float32), float32, bfloat16 "
                         "or float16", choices=DTYPES)
    device: str = setting("cpu", "cpu or cuda[:N]",
                          check=lambda d: d == "cpu" or d.startswith("cuda"),
                          must="cpu, cuda or cuda:N")
    backend: str = setting(
        "auto", "attention: auto (cpu on CPU where its kernel builds, else torch), cpu (C++ "
        "decode kernel), torch (reference: gather + SDPA) or flashinfer (CUDA)",
        choices=BACKENDS)
    # Bytes of KV blocks on CPU: 2 GiB holds ~45k tokens of SmolLM2-135M (fp32), what 64
    # concurrent chats need; never more blocks than max_num_seqs full-length sequences use.
    kv_cache_memory: int = setting(2 * 2**30, "bytes of KV blocks on CPU (e.g. 256MiB)",
                                   type=parse_bytes, check=positive,
                                   must="positive, e.g. 256MiB")
    gpu_memory_utilization: float = setting(
        0.9, "fraction of GPU memory for weights, activations and KV",
        check=lambda v: 0.0 < v <= 1.0, must="in (0, 1], e.g. 0.9")
    swap_space: float = setting(0.25, "GiB of CPU blocks for swap-out", check=at_least(0),
                                must=">= 0 GiB")
    cpu_cache_space: float = setting(
        0.0, "GiB of CPU blocks for the prefix cache's CPU tier: cached blocks evicted from "
        "the device are kept there and copied back on a hit (0: off)", check=at_least(0),
        must=">= 0 GiB (0: no CPU tier)")
    enable_lora: bool = setting(
        False, "serve LoRA adapters: --max-loras slots of --max-lora-rank, loaded by "
        "--lora-modules or at run time (the gateway's /v1/load_lora_adapter)")
    max_loras: int = setting(1, "with LoRA on: adapters resident at once", check=positive,
                             must="positive")
    max_lora_rank: int = setting(16, "with LoRA on: the highest adapter rank served (each "
                                 "slot's size)", check=lambda r: 1 <= r <= 512,
                                 must="in 1..512")
    lora_modules: tuple[tuple[str, str], ...] = setting(
        (), "LoRA adapters to load at start, NAME=DIR[,NAME=DIR...] (PEFT directories; "
        "turns LoRA on)", type=parse_lora_modules, metavar="NAME=DIR[,...]")
    tune_malloc: bool = setting(
        True, "CPU executors on glibc: one malloc arena, no mmap'ed chunks, freed memory "
        "kept, so that a step's large tensors reuse memory (true/false)")

    def __post_init__(self) -> None:
        ServingSettings.__post_init__(self)  # (no zero-argument super() in a slots dataclass)
        problems = [
            (self.backend == "cpu" and self.on_cuda,
             "--backend cpu runs on --device cpu; use auto, torch or flashinfer on CUDA"),
            (self.backend == "flashinfer" and not self.on_cuda,
             "--backend flashinfer needs --device cuda; use --backend torch on CPU"),
            (self.backend == "flashinfer" and self.dtype == "float32",
             "--backend flashinfer takes --dtype bfloat16 or float16 (or auto)"),
            (not Path(self.model).is_dir(), missing_model_message("--model", self.model)),
        ]
        problems.append((
            len(self.lora_modules) > self.max_loras,
            f"--lora-modules names {len(self.lora_modules)} adapters, more than --max-loras "
            f"{self.max_loras}; raise --max-loras"))
        fits, message = host_memory_check(self.swap_space, self.cpu_cache_space)
        problems.append((not fits, message))
        for wrong, why in problems:
            if wrong:
                raise SettingsError(why)

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m executor_svc",
        description="The pagedkv executor: model weights, paged KV cache, one step per Execute.",
    )
    add_settings(parser, ExecutorSettings)
    add_metrics_flags(parser, DEFAULT_METRICS_PORT)
    add_internal_auth_flags(parser)
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> ExecutorSettings:
    """The settings from `argv` (else sys.argv) and the environment; a value that cannot work
    is a usage error (exit 2) naming its flag."""
    return load(ExecutorSettings, build_parser(), argv, serving_flags)  # type: ignore[no-any-return]


def serving_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The settings either executor takes from its credential and metrics flags."""
    return {"auth": internal_auth_from_args(args), "metrics": metrics_endpoint(args)}
