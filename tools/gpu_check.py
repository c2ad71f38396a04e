"""The one prepared device run: every GPU question answered by one device call.

A task lent a GPU machine has about 15 minutes of it in all, no network, 64 MiB of the working
tree, and only the files written under $OUT come back (8 at most). So one call runs STAGES in
order of value, each under its own timeout and all within 8 minutes (a second call still fits
for the stages that failed: --only). Each
stage appends one JSON line to $OUT/stages.jsonl as soon as it ends and its output to
$OUT/stages.log, and writes its results under $OUT/results/: a cut-off loses the least.

Build the kit here with `make gpu-kit` (wheels, the FlashInfer bundle, the stubs), then the
device call is

    command: bash tools/gpu_check.sh        carry: [".gpu_kit", ".fi_bundle", "pagedkv"]

with timeout_s 600 and kind nvidia-h200.

`OUT=/tmp/out bash tools/gpu_check.sh --dry-run` runs the same table here on the CPU, each
command replaced by one that proves it would start (pytest --collect-only, bench --help, the
kernel check's CPU self-test). `--only a,b` reruns some stages.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 480.0
MIN_STAGE_S = 10.0  # less left than this: the stage is skipped, not started and cut short
TAIL_LINES = 20


@dataclass(frozen=True)
class Stage:
    name: str
    command: str  # as run on the device; {results} is $OUT/results, python3 this interpreter
    timeout_s: float
    note: str = ""
    dry_command: str | None = None  # None: derived by dry_command()
    reports_json: bool = False  # its last output line is a JSON object: the record's result


# -k matches substrings: "not float16" alone would drop the bfloat16 cases too.
BF16_ONLY = "float16 cases deselected: the bundle holds bf16 kernels only"
STAGES = (
    Stage("environment", "python3 -m tools.gpu_check --environment", 20, reports_json=True),
    Stage("flashinfer_kernels", "python3 .gpu_kit/flashinfer_gpu_check.py --hd 128", 45,
          dry_command="python3 .gpu_kit/flashinfer_gpu_check.py --cpu-selftest"),
    Stage("flashinfer_vs_torch", "python3 -m pytest -q -x -m gpu "
          "tests/executor/test_flashinfer_backend.py -k \"bfloat16 or not float16\"", 45,
          note=BF16_ONLY),
    Stage("stack_parity", "python3 -m bench.gpu --stage parity --out {results}", 80),
    Stage("conformance", "python3 -m pytest -q -x tests/conformance --executor-device cuda", 80),
    Stage("memory_profile", "python3 -m bench.gpu --stage memory --out {results}", 90),
    Stage("decode_bandwidth", "python3 -m bench.gpu --stage kernel --quick --out {results}", 45),
    Stage("e2e_decode", "python3 -m bench.gpu --stage e2e --quick --out {results}", 75),
    Stage("gpu_tests", "python3 -m pytest -q -m gpu tests/executor tests/e2e "
          "-k \"bfloat16 or not float16\"", 60, note=BF16_ONLY),
)


@dataclass(frozen=True)
class StageRecord:
    """One line of stages.jsonl."""

    name: str
    command: str
    status: str  # ok | failed | timed_out | skipped
    exit_code: int | None
    seconds: float
    timeout_s: float  # what it ran under: its own, or less where the deadline was nearer
    note: str = ""
    tail: list[str] | None = None  # the last output lines, when it did not pass
    result: dict[str, Any] | None = None


def dry_command(stage: Stage) -> str:
    """A command that proves, on a CPU, that the stage's own would start."""
    if stage.dry_command is not None:
        return stage.dry_command
    if " -m pytest " in stage.command:
        return stage.command + " --collect-only -q"  # an import failing at collection fails
    if " -m bench." in stage.command:
        return stage.command + " --help"  # then unknown_flags() checks the help names them
    return stage.command


def unknown_flags(command: str, help_text: str) -> list[str]:
    # argparse answers --help before it refuses an unknown flag: read the help instead.
    return [word for word in shlex.split(command)
            if word.startswith("--") and word != "--help" and word not in help_text]


def argv_of(command: str, results: Path) -> list[str]:
    argv = shlex.split(command.format(results=results))
    return [sys.executable if argv[0] == "python3" else argv[0], *argv[1:]]


def _kill_tree(process: subprocess.Popen[bytes]) -> None:
    # Its process group, and descendants that left it (a launcher's own sessions).
    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    for child in descendants:
        with suppress(psutil.Error):
            child.kill()
    with suppress(subprocess.TimeoutExpired):  # one stuck in the driver: go on without it
        process.wait(timeout=30)


def _run_one(stage: Stage, command: str, timeout_s: float, results: Path, log: IO[bytes],
             dry: bool) -> StageRecord:
    shown = command.format(results=results)
    log.write(f"==== {stage.name}: {shown} (timeout {timeout_s:.0f} s)\n".encode())
    log.flush()
    start_offset, started = os.fstat(log.fileno()).st_size, time.monotonic()
    exit_code: int | None = None
    try:
        # The child writes straight into the log: a cut-off keeps what it printed.
        process = subprocess.Popen(argv_of(command, results), cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            exit_code = process.wait(timeout=timeout_s)
            status = "ok" if exit_code == 0 else "failed"
        except subprocess.TimeoutExpired:
            _kill_tree(process)
            status = "timed_out"
    except OSError as error:
        log.write(f"could not start: {error}\n".encode())
        status = "failed"
    seconds = round(time.monotonic() - started, 2)
    log.flush()
    with open(log.name, "rb") as reader:
        reader.seek(start_offset)
        output = reader.read().decode(errors="replace")
    result = None
    if status == "ok" and dry and command.endswith(" --help"):
        missing = unknown_flags(stage.command, output)
        if missing:
            status, result = "failed", {"flags_not_in_help": missing}
            log.write(f"the help does not name {missing}\n".encode())
    if status == "ok" and stage.reports_json:
        try:
            result = json.loads(output.strip().splitlines()[-1])
        except (ValueError, IndexError):
            status = "failed"
    log.write(f"==== {stage.name}: {status} in {seconds} s\n\n".encode())
    tail = output.splitlines()[-TAIL_LINES:] if status != "ok" else None
    return StageRecord(stage.name, shown, status, exit_code, seconds, round(timeout_s, 1),
                       stage.note, tail, result)


def run_stages(stages: tuple[Stage, ...], out: Path, *, dry: bool = False,
               deadline_s: float = DEADLINE_S, min_stage_s: float = MIN_STAGE_S,
               report: Callable[[str], None] = print) -> list[StageRecord]:
    """Each stage in turn, whatever the last one did; one JSON line as each ends."""
    out = out.resolve()  # the stages run in the repository's root
    results = out / "results"
    results.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + deadline_s
    records = []
    with open(out / "stages.jsonl", "w") as jsonl, open(out / "stages.log", "ab") as log:
        for stage in stages:
            command = dry_command(stage) if dry else stage.command
            left = deadline - time.monotonic()
            if left < min_stage_s:
                record = StageRecord(stage.name, command.format(results=results), "skipped",
                                     None, 0.0, stage.timeout_s, "no time left")
            else:
                record = _run_one(stage, command, min(stage.timeout_s, left), results, log, dry)
            jsonl.write(json.dumps(asdict(record)) + "\n")
            jsonl.flush()
            records.append(record)
            exit_text = "" if record.exit_code is None else f" exit {record.exit_code}"
            report(f"{record.name:<20} {record.status:<9} {record.seconds:7.1f} s{exit_text}")
    return records


# The device's own packages the stages use: the kit's wheels come first on PYTHONPATH, so
# their needs are checked against the kit's versions too.
DEVICE_PACKAGES = ("torch", "triton", "transformers", "tokenizers", "huggingface-hub",
                   "safetensors")


def unmet_requirements(site: Path | None = None,
                       names: tuple[str, ...] = ()) -> list[str]:
    """What the kit's wheels in `site`, and the installed packages `names`, need that this
    interpreter (the kit first) lacks or has at another version."""
    from importlib import metadata

    from packaging.requirements import Requirement

    dists = list(metadata.distributions(path=[str(site)])) if site else []
    for name in names:
        with suppress(metadata.PackageNotFoundError):
            dists.append(metadata.distribution(name))
    unmet = []
    for dist in dists:
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(requirement.name)
            except metadata.PackageNotFoundError:
                unmet.append(f"{dist.metadata['Name']}: {text} (absent)")
                continue
            if not requirement.specifier.contains(have, prereleases=True):
                unmet.append(f"{dist.metadata['Name']}: {text} (have {have})")
    return sorted(set(unmet))


def environment() -> dict[str, Any]:
    """Versions and the device, for the environment stage's JSON line."""
    from importlib import metadata

    info: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable,
                            "kit_setup": os.environ.get("GPU_KIT_SETUP")}
    for name in ("torch", "triton", "transformers", "grpcio", "protobuf", "numpy"):
        with suppress(metadata.PackageNotFoundError):
            info[name] = metadata.version(name)
    try:
        import flashinfer

        info["flashinfer"] = flashinfer.__version__
    except Exception as error:  # noqa: BLE001 - absent or broken: either is the answer
        info["flashinfer"] = f"unavailable: {type(error).__name__}: {error}"
    try:
        import pagedkv.executor.v1.executor_pb2_grpc  # noqa: F401 - checks grpcio's version

        info["stubs"] = "ok"
    except Exception as error:  # noqa: BLE001
        info["stubs"] = f"{type(error).__name__}: {error}"
    site = os.environ.get("GPU_KIT_SITE")
    info["kit_unmet_requirements"] = unmet_requirements(Path(site)) if site else None
    info["device_unmet_requirements"] = unmet_requirements(names=DEVICE_PACKAGES)
    try:
        import torch
    except Exception as error:  # noqa: BLE001 - the kit's wheels shadow some of torch's needs
        info["torch_import"] = f"{type(error).__name__}: {error}"
        return info
    info["cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if info["cuda_available"]:
        free, total = torch.cuda.mem_get_info()
        info.update(device=torch.cuda.get_device_name(),
                    capability=list(torch.cuda.get_device_capability()),
                    memory_total_gib=round(total / 2**30, 2),
                    memory_free_gib=round(free / 2**30, 2))
        with suppress(OSError, subprocess.SubprocessError):
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10).stdout.strip()
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="$OUT of the device call")
    parser.add_argument("--dry-run", action="store_true",
                        help="on a CPU: each stage's command replaced by one proving it starts")
    parser.add_argument("--only", default="", help="comma-separated stage names")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S)
    parser.add_argument("--environment", action="store_true",
                        help="print the environment stage's JSON line and exit")
    args = parser.parse_args(argv)
    if args.environment:
        print(json.dumps(environment()))
        return 0
    names = [name for name in args.only.split(",") if name]
    unknown = sorted(set(names) - {stage.name for stage in STAGES})
    if args.out is None or unknown:
        parser.print_usage(sys.stderr)
        print(f"--out is required; stages are {[s.name for s in STAGES]}"
              + (f", not {unknown}" if unknown else ""), file=sys.stderr)
        return 2
    stages = tuple(stage for stage in STAGES if not names or stage.name in names)
    run_stages(stages, args.out, dry=args.dry_run, deadline_s=args.deadline_s)
    return 0  # stages.jsonl says what failed


if __name__ == "__main__":
    raise SystemExit(main())
