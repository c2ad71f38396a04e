"""`python -m executor_svc`: load the model, size the KV cache, serve until SIGTERM.

With `--port 0` the bound port is logged (`server_started port=...`) and, with `--port-file`,
written to that file once the server accepts calls (written whole, then renamed); the same for
the metrics port (`--metrics-port`, `--metrics-port-file`), bound once the model is loaded.

torch, grpc and transformers are imported only after malloc is tuned (malloc_tuning.py): they
start threads, and a thread that allocates before the tuning keeps an arena of its own.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

import structlog

from common.logging import configure_logging
from executor_svc.malloc_tuning import tune_malloc
from executor_svc.settings import ExecutorSettings, SettingsError, parse_settings

log = structlog.get_logger("executor_svc")


async def serve(settings: ExecutorSettings) -> None:
    # (Imported here: after malloc is tuned, see the module docstring.)
    from executor_svc.compute_thread import compute_thread
    from executor_svc.runner import build_runner
    from executor_svc.serving import serve_runner

    worker = compute_thread()
    runner = await asyncio.get_running_loop().run_in_executor(worker, build_runner, settings)
    info = runner.info
    await serve_runner(settings, runner, worker, backend=info.backend, device=info.device)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)  # a value that cannot work: a usage error (exit 2)
    # Before torch and grpc are imported (module docstring). On CUDA a step's large tensors
    # live on the device: nothing to gain, and the host copies of the weights made while
    # loading could stay in the heap, never returned to the system.
    malloc_tuned = settings.tune_malloc and not settings.on_cuda and tune_malloc()
    configure_logging("executor", json=settings.log_json, level=settings.log_level)
    log.info("malloc_settings", tuned=malloc_tuned, requested=settings.tune_malloc,
             skipped="cuda" if settings.tune_malloc and settings.on_cuda else None)
    from common.metrics import MetricsPortError
    from executor_svc.model_loader import ModelLoadError

    try:
        asyncio.run(serve(settings))
    except (SettingsError, ModelLoadError, MetricsPortError) as exc:
        log.error("executor_failed_to_start", error=str(exc))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
