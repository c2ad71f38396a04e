"""A loopback TCP port that forwards to another address: opened late (a gateway port that
comes up a moment after its client starts) and cut at will (a connection lost mid-stream)."""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class Relay:
    target: str  # host:port
    port: int = field(default_factory=free_port)
    listener: socket.socket | None = None
    sockets: list[socket.socket] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen()
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        """Stop listening and drop every connection."""
        with self.lock:
            for s in [*self.sockets, *([self.listener] if self.listener else [])]:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self.sockets.clear()
            self.listener = None

    def _accept(self, listener: socket.socket) -> None:
        host, port = self.target.rsplit(":", 1)
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection((host, int(port)))
            except OSError:
                return
            with self.lock:
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)
