"""The HTTP API's server: uvicorn on the gateway's own event loop, beside the gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

STOP_TIMEOUT_S = 10.0


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The gateway handles SIGTERM/SIGINT itself (it drains both servers): uvicorn must not
        # take them over.
        yield


class HttpServer:
    def __init__(self, app: FastAPI, host: str, port: int, *, tls_cert: str = "",
                 tls_key: str = "") -> None:
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))  # now: a port in use fails the start, in one line
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off",
            ssl_certfile=tls_cert or None, ssl_keyfile=tls_key or None,
            timeout_graceful_shutdown=int(STOP_TIMEOUT_S),
        )
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped at start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, STOP_TIMEOUT_S + 1)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        self._socket.close()
