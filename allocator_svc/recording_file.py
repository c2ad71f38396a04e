"""The append-only file behind an allocation recording (recording.py says what goes in it).

Lines are buffered on the event loop and handed over every FLUSH_BYTES (and whenever the
recorder flushes: every second) to a writer thread, which does the write system calls: a
slow or stuck disk never holds up a Step. Bounded twice: the file stops growing at
`max_bytes`, and a writer more than MAX_BACKLOG_BYTES behind (the disk cannot keep up) stops
the recording rather than grow the allocator's memory. A write that fails stops it too; the
recorder learns of it from `failure()` and says so once. The writer thread is the only one
that touches the file after it is opened; the counters each have one writer.
"""

from __future__ import annotations

import os
import queue
import threading
import time

# NOTE: each hand-over wakes the writer, which then takes the GIL from the event loop; in a
# loop with no idle time that cost the Steps ~25 us each at 64 KiB (bench.allocation_replay),
# and nothing measurable at 1 MiB. A serving loop idles between calls, and the writer takes
# the GIL then; the periodic flush (every second) bounds how long a record stays in memory.
FLUSH_BYTES = 1 << 20
MAX_BACKLOG_BYTES = 16 << 20
CLOSE_TIMEOUT_S = 10.0


class RecordingOpenError(Exception):
    """The recording file cannot be opened at start (the message says which and why)."""


class RecordingFile:
    def __init__(self, path: str, max_bytes: int) -> None:
        self.path, self.max_bytes = path, max_bytes
        try:
            self.file = open(path, "ab")  # closed by the writer thread
            size = self.file.seek(0, os.SEEK_END)
            if size:
                with open(path, "rb") as previous:
                    previous.seek(size - 1)
                    if previous.read(1) != b"\n":
                        self.file.write(b"\n")  # its last line was cut (a crash): end it
                        size += 1
        except OSError as exc:
            raise RecordingOpenError(
                f"--record-allocations {path}: cannot append to it ({exc.strerror}): name a "
                "file in a writable directory") from exc
        self.num_bytes = size  # in the file or on the way (the event loop's count)
        self.buffer: list[str] = []
        self.num_buffered = 0
        self.num_handed = size  # handed to the writer (the event loop's count)
        self.num_written = size  # written (the writer's count)
        self.error: OSError | None = None  # the writer's, once
        self.reported = False
        self.closed = False
        self.chunks: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.writer = threading.Thread(target=self._write_chunks, name="allocation-recording",
                                       daemon=True)
        self.writer.start()

    def write(self, line: str) -> bool:
        """Buffer `line`; False (nothing buffered) when it would pass the bound."""
        if self.num_bytes + len(line) > self.max_bytes:
            return False
        self.buffer.append(line)
        self.num_bytes += len(line)
        self.num_buffered += len(line)
        if self.num_buffered >= FLUSH_BYTES:
            self.flush()
        return True

    def flush(self) -> None:
        """Hand the buffer to the writer (no system call here)."""
        if self.buffer and not self.closed:
            data = "".join(self.buffer).encode("ascii")
            self.buffer.clear()
            self.num_buffered = 0
            self.num_handed += len(data)
            self.chunks.put(data)

    def failure(self) -> str | None:
        """Why the file stopped taking records (once), if it did: a failed write, a backlog."""
        if self.reported:
            return None
        if self.error is not None:
            self.reported = True
            return f"io_error: {self.error}"
        if self.num_handed - self.num_written > MAX_BACKLOG_BYTES:
            self.reported = True
            return "backlog: the disk does not keep up"
        return None

    def settle(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until everything handed over is written (tests, tools); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.num_written < self.num_handed and self.writer.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self, last: str = "", wait: bool = False) -> None:
        """Write `last` (past the bound if need be) and what is buffered; the writer closes
        the file once it has written them. `wait` for it only at shutdown: serving, a slow
        disk must not hold up the event loop."""
        if self.closed:
            return
        if last:
            self.buffer.append(last)
            self.num_bytes += len(last)
        self.flush()
        self.closed = True
        self.chunks.put(None)
        if wait:
            self.writer.join(CLOSE_TIMEOUT_S)

    def abandon(self) -> None:
        """Stop at once: what is buffered is dropped."""
        self.buffer.clear()
        self.closed = True
        self.chunks.put(None)

    def _write_chunks(self) -> None:
        try:
            while (chunk := self.chunks.get()) is not None:
                if self.error is None:
                    try:
                        self.file.write(chunk)
                        self.file.flush()
                    except OSError as exc:
                        self.error = exc
                self.num_written += len(chunk)
        finally:
            try:
                self.file.close()
            except OSError as exc:
                self.error = self.error or exc
