"""The ids a request's sequences take at the allocator and the executors.

n == 1: the request's own id. n > 1: `<id>-prefill` for the prefill parent (when the prompt has
two tokens or more) and `<id>-<i>` for the children. Beam search: `<id>-beam-<j>`, j below
twice the beam width: at most beam_width beams run, forks take the lowest j free (a pruned
beam's j is free again once its Free and Release have gone out, before the next fork). On the
wire every one is prefixed with the gateway's namespace (`wire_id`), new at every start: two
gateways on one allocator, or a gateway and its own previous run, never name the same
sequence.
"""

from __future__ import annotations


def wire_id(namespace: str, request_id: str) -> str:
    return f"{namespace}{request_id}"


def child_seq_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


def prefill_parent_id(request_id: str) -> str:
    return f"{request_id}-prefill"


def beam_seq_id(request_id: str, slot: int) -> str:
    return f"{request_id}-beam-{slot}"


def num_beam_slots(beam_width: int) -> int:
    """Ids a search may use: beam_width beams running, and up to beam_width - 1 forks named
    before the pruned ones are freed."""
    return 2 * beam_width


def sequence_ids(request_id: str, n: int, num_prompt_tokens: int, beam_width: int = 0
                 ) -> list[str]:
    """Every id a request's sequences take at the allocator and the executors: two live
    requests must not share one (the allocator would refuse the second admission)."""
    if beam_width:
        return [beam_seq_id(request_id, j) for j in range(num_beam_slots(beam_width))]
    if n == 1:
        return [request_id]
    children = [child_seq_id(request_id, i) for i in range(n)]
    if num_prompt_tokens >= 2:
        return [prefill_parent_id(request_id), *children]
    return children
