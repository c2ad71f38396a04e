"""A recording's lines as JSON objects, read as a stream (recordings grow to hundreds of MiB).

Each header line starts a segment (an allocator appends one each time it starts on the file).
A line that is not a JSON object is an error, unless it is the last of its segment: an
allocator killed mid-write leaves a line cut short (the next one to start on the file ends it
before its own header), which is skipped with a warning.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any

from allocator_svc.recording import FORMAT, VERSION
from tools.replay.records import RecordingError

NOT_A_RECORDING = (f'not a pagedkv allocation recording: expected a header {{"format": '
                   f'"{FORMAT}", "version": {VERSION}, ...}}')


def read_lines(path: str, warnings: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for every line; a skipped line's warning goes to `warnings`.
    A path ending in .gz is read through gzip."""
    try:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as file:
            yield from _records(path, file, warnings)
    except (OSError, EOFError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise RecordingError(f"{path}: cannot read it ({reason})") from exc


def is_header(record: dict[str, Any]) -> bool:
    return "format" in record


def _records(path: str, file: Any, warnings: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    cut: tuple[int, str] | None = None  # a line that did not parse, until we know why
    number = 0
    for number, raw in enumerate(file, start=1):
        record = _parse(raw)
        if record is None:
            if number == 1:
                raise RecordingError(f"{path}, line 1: {NOT_A_RECORDING}")
            if cut is not None:
                break
            cut = (number, "not JSON" if raw.endswith(b"\n") else "cut short")
            continue
        if cut is not None:
            if not is_header(record):
                break
            warnings.append(f"line {cut[0]}: a record cut short (the allocator stopped "
                            "mid-write) was skipped")
            cut = None
        yield number, record
    else:
        if number == 0:
            raise RecordingError(f"{path}: empty: {NOT_A_RECORDING}")
        if cut is not None:
            warnings.append(f"line {cut[0]}: the last record was cut short (the allocator "
                            "stopped mid-write) and was skipped")
        return
    assert cut is not None
    raise RecordingError(f"{path}, line {cut[0]}: not a JSON record ({cut[1]}), and not the "
                         "last line of a segment")


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None
