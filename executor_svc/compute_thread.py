"""The one thread that runs torch in an executor (loading the model, every step and release),
and the queue in front of it (ComputeQueue).

NOTE: OpenMP (libgomp, torch's CPU backend) gives every thread that starts parallel work a
thread team of its own. With two such threads in one process (the model loaded in one, the
steps run in another) it manages more threads than there are cores, and then it stops
spinning between parallel regions: each of a step's hundreds of small ops waits for its
team to wake up (figures: bench/README.md, "Executor CPU kernels"). So everything that
touches torch runs here, one call at a time, in submission order.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from executor_svc.merged_calls import CallShape, calls_to_merge
from executor_svc.step import StepRequest

T = TypeVar("T")


def compute_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-compute")


class ComputeQueue:
    """What the compute thread runs, in arrival order: jobs (Release, an import's block
    writes) one at a time, and Execute calls, which merge with the calls waiting beside them
    into one forward (merged_calls.py: which ones). A job is a barrier: no call queued after
    it runs before it, as none ran before it when each call had its own turn.

    While anything waits, one drain runs in the thread and takes the next turn the moment the
    last ends, with no hop through the event loop. Results go back to each caller's loop.
    """

    def __init__(self, worker: ThreadPoolExecutor,
                 execute_merged: Callable[[list[StepRequest]], list[Any]],
                 max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """`execute_merged(steps)`: each step's outcome, a result or an exception, in order
        (an exception it raises goes to every call of the turn)."""
        self._worker = worker
        self._execute_merged = execute_merged
        self._limits = (max_num_seqs, max_num_batched_tokens)
        self._lock = threading.Lock()
        self._waiting: deque[_Job | _Call] = deque()
        self._draining = False

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`fn(*args)` alone in its turn, in the caller's context (its log bindings). It runs
        even if the caller stops waiting."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._add(_Job(future, fn, args, contextvars.copy_context()))
        return future

    def execute(self, step: StepRequest, step_id: int = 0,
                previous_step_id: int = 0) -> asyncio.Future[Any]:
        """The call's outcome once its forward has run; `withdraw` it if its caller goes."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._add(_Call(future, step, CallShape.of(step, step_id, previous_step_id)))
        return future

    def num_waiting(self) -> int:
        """Calls and jobs whose turn has not come."""
        with self._lock:
            return len(self._waiting)

    def withdraw(self, future: asyncio.Future[Any]) -> bool:
        """Drop a call whose turn has not come (its caller went away); False if it has."""
        with self._lock:
            for entry in self._waiting:
                if entry.future is future:
                    self._waiting.remove(entry)
                    return True
        return False

    def _add(self, entry: _Job | _Call) -> None:
        with self._lock:
            self._waiting.append(entry)
            start, self._draining = not self._draining, True
        if start:
            self._worker.submit(self._drain)

    def _drain(self) -> None:  # in the compute thread
        while True:
            with self._lock:
                turn = self._next_turn()
                if not turn:
                    self._draining = False
                    return
            if isinstance(turn[0], _Job):
                job = turn[0]
                _settle(job.future, _outcome(job.context.run, job.fn, *job.args))
                continue
            calls = [c for c in turn if isinstance(c, _Call)]
            try:
                outcomes = self._execute_merged([c.step for c in calls])
                if len(outcomes) != len(calls):
                    raise RuntimeError(f"{len(outcomes)} outcomes for {len(calls)} calls")
            except Exception as failure:  # noqa: BLE001 - every caller of the turn hears it
                outcomes = [failure] * len(calls)
            for call, outcome in zip(calls, outcomes, strict=True):
                _settle(call.future, outcome)

    def _next_turn(self) -> list[_Job | _Call]:
        """Under the lock: the head job alone, or the calls before the first job that merge."""
        waiting = self._waiting
        if not waiting:
            return []
        if isinstance(waiting[0], _Job):
            return [waiting.popleft()]
        calls: list[_Call] = []
        for entry in waiting:
            if isinstance(entry, _Job):
                break
            calls.append(entry)
        taken = [calls[i] for i in calls_to_merge([c.shape for c in calls], *self._limits)]
        for call in taken:
            waiting.remove(call)
        return list(taken)


@dataclass(slots=True, eq=False)
class _Job:
    future: asyncio.Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    context: contextvars.Context


@dataclass(slots=True, eq=False)
class _Call:
    future: asyncio.Future[Any]
    step: StepRequest
    shape: CallShape


def _outcome(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as failure:  # noqa: BLE001 - the caller's future carries it
        return failure


def _settle(future: asyncio.Future[Any], outcome: Any) -> None:
    """Hand `outcome` to the future's loop (an exception is raised to its awaiter)."""
    def settle() -> None:
        if future.done():  # its caller stopped waiting
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    try:
        future.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: the server is gone, and so is the caller
        pass
