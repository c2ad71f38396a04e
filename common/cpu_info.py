"""What /proc/cpuinfo says of this machine's CPU: its vendor, model and instruction-set flags.

Kernels are chosen (MKL on Intel only), built (-march=native's digest) and reported (every
results file) by these, so they are read once, in one place. Off Linux every field is empty.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def cpuinfo() -> dict[str, str]:
    """The first processor's fields (`vendor_id`, `model name`, `flags`, ...), or {}."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block ends at its blank line
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_vendor() -> str:
    """e.g. GenuineIntel or AuthenticAMD; empty where unknown."""
    return cpuinfo().get("vendor_id", "")


def cpu_model() -> str:
    return cpuinfo().get("model name", "")


def cpu_flags() -> frozenset[str]:
    return frozenset(cpuinfo().get("flags", "").split())
