"""The engines' own event loop, on a thread of its own, apart from the API's.

Every engine's step loop, the allocator and executor clients, the lease and the router run
on it. The API's loop (the gRPC server, tokenization, detokenized text reaching the streams)
never runs them, so a slow handler or a burst of stream writes does not hold a step up, and a
step does not hold a handler up. The loops meet in three places:

- submit: a request goes to the router on the engine loop, which may ask the allocator where
  its prefix is cached, and the engine chosen (or the refusal) comes back;
- cancel: posted to the engine loop, which aborts the request's sequences before its next step;
- outputs: each Request posts its deltas (token ids, no text) to the loop that created it
  (request_state.py), where they are detokenized (text/output.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

from gateway.core.request_state import Request
from gateway.engine.loop import Engine
from gateway.engine.router import Router

T = TypeVar("T")


class EngineHost:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="engine-loop", daemon=True)
        self.router: Router | None = None  # set once the engines are built (on this loop)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self.thread.start()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the engine loop and wait for it from the caller's loop. The caller's
        log context (the request id) goes along."""
        bound = structlog.contextvars.get_contextvars()

        async def with_context() -> T:
            structlog.contextvars.bind_contextvars(**bound)
            return await coro

        return await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(with_context(), self.loop)
        )

    def _router(self) -> Router:
        assert self.router is not None, "the engines are not built yet"
        return self.router

    async def submit(self, request: Request) -> Engine:
        return await self.run(self._router().submit(request))

    def cancel(self, request: Request) -> None:
        if self.loop.is_closed():  # stopped: nothing runs it any more
            request.cancelled = True
            return
        self.loop.call_soon_threadsafe(self._router().cancel, request)

    @property
    def engines(self) -> list[Engine]:
        """For reading (health, descriptions); only the engine loop changes them."""
        return self._router().engines

    def stop(self) -> None:
        """Stop the loop (its tasks cancelled and its channels closed by the caller first)."""
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()
