"""tools/gpu_check.py, the one prepared device run: its runner on fake stages (shell commands,
no Python started), the real stage table, the kit's pins and size check, and
tools/gpu_check.sh --dry-run for real here on the CPU (e2e)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tools import gpu_kit
from tools.gpu_check import (
    DEADLINE_S,
    STAGES,
    Stage,
    StageRecord,
    dry_command,
    main,
    run_stages,
    unknown_flags,
)

ROOT = Path(__file__).resolve().parents[2]


def _run(stages: tuple[Stage, ...], out: Path, **kwargs: Any) -> tuple[list[StageRecord],
                                                                       list[str]]:
    printed: list[str] = []
    return run_stages(stages, out, report=printed.append, **kwargs), printed


def _lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]


def test_gpu_check_records_every_stage_and_goes_on_after_a_failure(tmp_path: Path) -> None:
    # Passes, fails with exit 3, passes: one JSON line each as it ends, the failure's tail.
    stages = (Stage("passes", "sh -c 'echo fine'", 10),
              Stage("fails", "sh -c 'echo one; echo two; exit 3'", 10),
              Stage("after", "sh -c 'echo after'", 10))
    _, printed = _run(stages, tmp_path)
    lines = _lines(tmp_path)
    assert [(r["name"], r["status"], r["exit_code"]) for r in lines] == [
        ("passes", "ok", 0), ("fails", "failed", 3), ("after", "ok", 0)]
    assert [lines[0]["tail"], lines[1]["tail"]] == [None, ["one", "two"]]
    assert [line.split()[:2] for line in printed] == [
        ["passes", "ok"], ["fails", "failed"], ["after", "ok"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results", "stages.jsonl", "stages.log"]
    log = (tmp_path / "stages.log").read_text()
    assert "==== passes: sh -c 'echo fine' (timeout 10 s)\nfine\n==== passes: ok in" in log
    assert "one\ntwo\n==== fails: failed in" in log


def test_gpu_check_kills_a_stage_past_its_timeout_with_its_children(tmp_path: Path) -> None:
    # The stage's shell and the sleep it put in the background die at its 1 s timeout; the
    # next stage still runs.
    pid_file = tmp_path / "child.pid"
    stages = (Stage("hangs", f"sh -c 'sleep 60 & echo $! > {pid_file}; wait'", 1),
              Stage("next", "true", 10))
    started = time.monotonic()
    records, _ = _run(stages, tmp_path / "out")
    assert time.monotonic() - started < 10
    assert [(r.status, r.exit_code) for r in records] == [("timed_out", None), ("ok", 0)]
    child = int(pid_file.read_text())
    try:
        assert psutil.Process(child).status() == psutil.STATUS_ZOMBIE  # dead, not yet reaped
    except psutil.NoSuchProcess:
        pass


def test_gpu_check_deadline_cuts_a_timeout_and_skips_what_it_leaves_no_time_for(
        tmp_path: Path) -> None:
    # A 2 s deadline: the first stage's own 60 s timeout becomes what is left; the last has
    # under min_stage_s left and is skipped, not started.
    stages = (Stage("long", "sleep 60", 60), Stage("last", "true", 10))
    records, _ = _run(stages, tmp_path, deadline_s=2, min_stage_s=1)
    assert [(r.name, r.status) for r in records] == [("long", "timed_out"), ("last", "skipped")]
    assert records[0].timeout_s <= 2 and 1.5 < records[0].seconds < 6
    assert (records[1].note, records[1].timeout_s) == ("no time left", 10)
    assert [r["status"] for r in _lines(tmp_path)] == ["timed_out", "skipped"]


def test_gpu_check_stage_reporting_json_puts_its_last_line_in_the_record(tmp_path: Path) -> None:
    # {{ }}: commands are format strings ({results}).
    stages = (Stage("reports", """sh -c "echo noise; echo '{{\\"gpu\\": \\"none\\"}}'" """, 10,
                    reports_json=True),
              Stage("garbled", "sh -c 'echo not json'", 10, reports_json=True))
    records, _ = _run(stages, tmp_path)
    assert [(r.status, r.result) for r in records] == [("ok", {"gpu": "none"}), ("failed", None)]


def test_gpu_check_stage_table_is_in_order_of_value() -> None:
    assert [(s.name, s.command) for s in STAGES] == [
        ("environment", "python3 -m tools.gpu_check --environment"),
        ("flashinfer_kernels", "python3 .gpu_kit/flashinfer_gpu_check.py --hd 128"),
        ("flashinfer_vs_torch", "python3 -m pytest -q -x -m gpu "
         'tests/executor/test_flashinfer_backend.py -k "bfloat16 or not float16"'),
        ("stack_parity", "python3 -m bench.gpu --stage parity --out {results}"),
        ("conformance", "python3 -m pytest -q -x tests/conformance --executor-device cuda"),
        ("memory_profile", "python3 -m bench.gpu --stage memory --out {results}"),
        ("decode_bandwidth", "python3 -m bench.gpu --stage kernel --quick --out {results}"),
        ("e2e_decode", "python3 -m bench.gpu --stage e2e --quick --out {results}"),
        ("gpu_tests", 'python3 -m pytest -q -m gpu tests/executor tests/e2e '
         '-k "bfloat16 or not float16"'),
    ]
    # Every stage but the last gets its whole timeout even if all before it use theirs; the
    # last (the remaining gpu tests) gets what they leave.
    assert sum(s.timeout_s for s in STAGES[:-1]) <= DEADLINE_S


def test_gpu_check_dry_commands_prove_each_stage_would_start() -> None:
    # pytest collects (an import failing at collection fails), bench prints its help, the
    # kernel check runs its CPU self-test, the environment runs as is.
    dry = {s.name: dry_command(s) for s in STAGES}
    assert dry["environment"] == STAGES[0].command
    assert dry["flashinfer_kernels"] == "python3 .gpu_kit/flashinfer_gpu_check.py --cpu-selftest"
    for stage in STAGES[2:]:
        suffix = " --collect-only -q" if " -m pytest " in stage.command else " --help"
        assert dry[stage.name] == stage.command + suffix


def test_gpu_check_help_must_name_every_flag_the_stage_uses() -> None:
    # argparse answers --help before it refuses an unknown flag, so the help is read instead.
    help_text = "usage: python -m bench.gpu [-h] [--quick] [--out OUT]"
    assert unknown_flags("python3 -m bench.gpu --stage e2e --quick --out x --help",
                         help_text) == ["--stage"]


def test_gpu_check_usage_errors_exit_2(tmp_path: Path) -> None:
    assert main(["--dry-run"]) == 2  # no --out
    assert main(["--out", str(tmp_path), "--only", "environment,nope"]) == 2
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path), "--no-such-flag"])
    assert exited.value.code == 2
    assert list(tmp_path.iterdir()) == []  # nothing ran


def test_gpu_kit_pins_one_version_of_each_and_leaves_the_device_its_own() -> None:
    pins = gpu_kit.pinned_versions()
    assert len(pins) == len(gpu_kit.KIT_PACKAGES)
    assert {"grpcio", "protobuf", "structlog", "fastapi", "pydantic-core"} <= pins.keys()
    device_own = {"torch", "triton", "transformers", "tokenizers", "safetensors", "numpy"}
    assert not device_own & pins.keys()
    assert gpu_kit.wheel_key("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl") == (
        "pydantic-core", "2.50.5")


def test_gpu_kit_size_check_fails_over_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_kit.check_sizes({"working tree": 2**20, ".gpu_kit": 2**20}, limit_mib=2)
    assert not gpu_kit.check_sizes({"working tree": 2**20, ".gpu_kit": 2**20 + 1}, limit_mib=2)
    assert "total              2.0 MiB" in capsys.readouterr().out


def test_gpu_check_carry_list_is_the_one_the_docs_give() -> None:
    carry = json.dumps(list(gpu_kit.CARRIED))
    assert carry == '[".gpu_kit", ".fi_bundle", "pagedkv"]'
    for path in ("tools/gpu_check.py", "tools/gpu_check.sh"):
        assert f"carry: {carry}" in (ROOT / path).read_text(), path


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str],
                                                               Path]:
    out = tmp_path_factory.mktemp("gpu-check-out")
    done = subprocess.run(["bash", "tools/gpu_check.sh", "--dry-run"], cwd=ROOT, text=True,
                          capture_output=True, timeout=240, env={**os.environ, "OUT": str(out)})
    return done, out


@pytest.mark.e2e
@pytest.mark.gpu_kit  # make gpu-check-dry
def test_gpu_check_dry_run_records_every_stage_in_out(
        dry_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    done, out = dry_run
    assert done.returncode == 0, done.stderr
    names = [s.name for s in STAGES]
    assert [line.split()[0] for line in done.stdout.splitlines()] == names
    assert sorted(p.name for p in out.iterdir()) == ["results", "stages.jsonl", "stages.log"]
    records = {r["name"]: r for r in _lines(out)}
    assert list(records) == names
    assert all(r["status"] in ("ok", "failed") for r in records.values()), records
    environment = records["environment"]
    assert environment["status"] == "ok"
    assert environment["result"]["cuda_available"] is False
    assert environment["result"]["stubs"] == "ok"
    if (ROOT / ".gpu_kit" / "flashinfer_gpu_check.py").is_file():  # make gpu-kit was run
        assert records["flashinfer_kernels"]["status"] == "ok", records["flashinfer_kernels"]


@pytest.mark.e2e
@pytest.mark.gpu_kit  # make gpu-check-dry
def test_gpu_check_dry_run_collects_the_gpu_tests_and_finds_the_flags(
        dry_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    # Every stage but the bundle's kernel check (which needs `make gpu-kit`) starts here: its
    # tests collect (with their -m / -k selection) and its benchmark names every flag it uses.
    records = {r["name"]: r for r in _lines(dry_run[1])}
    for name in ("flashinfer_vs_torch", "gpu_tests", "conformance", "stack_parity",
                 "memory_profile", "decode_bandwidth", "e2e_decode"):
        assert records[name]["status"] == "ok", records[name]
