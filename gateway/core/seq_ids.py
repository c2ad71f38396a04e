"""The ids a request's sequences take at the allocator and the executors.

n == 1: the request's own id. n > 1: `<id>-prefill` for the prefill parent (when the prompt has
two tokens or more) and `<id>-<i>` for the children. On the wire every one is prefixed with the
gateway's namespace (`wire_id`), new at every start: two gateways on one allocator, or a
gateway and its own previous run, never name the same sequence.
"""

from __future__ import annotations


def wire_id(namespace: str, request_id: str) -> str:
    return f"{namespace}{request_id}"


def child_seq_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


def prefill_parent_id(request_id: str) -> str:
    return f"{request_id}-prefill"


def sequence_ids(request_id: str, n: int, num_prompt_tokens: int) -> list[str]:
    """Every id a request's sequences take at the allocator and the executors: two live
    requests must not share one (the allocator would refuse the second admission)."""
    if n == 1:
        return [request_id]
    children = [child_seq_id(request_id, i) for i in range(n)]
    if num_prompt_tokens >= 2:
        return [prefill_parent_id(request_id), *children]
    return children
