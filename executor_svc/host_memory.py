"""How much host memory this machine can give the executor's CPU blocks."""

from __future__ import annotations

import os
from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def available_host_bytes(meminfo: Path = MEMINFO) -> int:
    """Linux's MemAvailable (memory a new allocation can have without swapping); elsewhere
    the physical memory."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
