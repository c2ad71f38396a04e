"""common.cpu_info against lscpu, which reads the same CPU its own way (util-linux)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from common.cpu_info import cpu_flags, cpu_model, cpu_vendor, cpuinfo


def _lscpu() -> dict[str, str]:
    if shutil.which("lscpu") is None or not Path("/proc/cpuinfo").exists():
        pytest.skip("needs Linux's /proc/cpuinfo and lscpu (util-linux): run `.venv/bin/python "
                    "-m pytest tests/common/test_cpu_info.py` on Linux")
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True,
                         env={"LC_ALL": "C"}).stdout
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}


def test_vendor_model_and_flags_are_what_lscpu_says() -> None:
    listed = _lscpu()
    assert cpu_vendor() == listed["Vendor ID"]
    assert cpu_model() == listed["Model name"]
    assert cpu_flags() == frozenset(listed["Flags"].split())


def test_only_the_first_processors_fields_are_read() -> None:
    _lscpu()
    first_block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    assert cpuinfo()["processor"] == "0"
    assert len(cpuinfo()) == len([line for line in first_block.splitlines() if ":" in line])
