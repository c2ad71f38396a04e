"""How many examples a property test draws: all of them in `make test`; a tenth (at least 5)
in `make test-fast` (PAGEDKV_TEST_FAST=1), a quick loop between edits, not the proof."""

from __future__ import annotations

import os

FAST = os.environ.get("PAGEDKV_TEST_FAST") == "1"


def examples(full: int) -> int:
    return max(5, full // 10) if FAST else full
