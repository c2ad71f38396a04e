"""Beam search as plain values: the beams, the finished hypotheses, and one step's selection.

It reproduces transformers' `generate(num_beams=k, do_sample=False)` (`_beam_search`, batch of
one) token for token, scores included: every score is float32 and rounded as torch rounds it.
One step, given each running beam's `num_candidates` most likely next tokens and their
log-probabilities under the raw model distribution:

    candidates  = (beam score + logprob) over every running beam, the num_candidates best
    ended       = those whose token is a stop token (EOS, stop_token_ids), or all of them at
                  max_tokens
    running     = the first beam_width candidates that did not end, best first
    finished   += the ended among the first beam_width candidates, scored
                  sum / (generated tokens ** length_penalty); the beam_width best are kept
    done        = at max_tokens; or early_stopping WHEN_FULL and beam_width finished; or no
                  running beam can beat the worst finished one (transformers' heuristic: the best
                  running score at today's length, or at max_tokens for NEVER with a positive
                  length penalty)

The first step has one beam (transformers starts with k copies of the prompt, all but one at
-1e9, so only that one's continuations can win). A beam continues in place with its best
continuation and is forked for the others; a beam with none is pruned. Beams are named by
opaque handles (the engine's sequences; strings in tests): `select` says which handle
continues with which token, which handles fork from which, and which are freed.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

H = TypeVar("H")

# transformers' score for "no hypothesis here" (and for beams that may not win), in float32.
NO_SCORE = -1.0e9


def f32(value: float) -> float:
    """`value` rounded to float32. An operation on two float32 values done in float64 and then
    rounded is the float32 operation exactly (53 >= 2 * 24 + 2 bits), so this is torch's."""
    result: float = struct.unpack("f", struct.pack("f", value))[0]
    return result


class EarlyStopping(enum.Enum):
    """transformers' `early_stopping`: False, True, "never"."""

    HEURISTIC = "heuristic"  # False: stop when the best running beam, at its length, cannot win
    WHEN_FULL = "when_full"  # True: stop as soon as beam_width hypotheses are finished
    NEVER = "never"          # the heuristic at max_tokens when length_penalty > 0 (canonical)


@dataclass(frozen=True, slots=True)
class BeamConfig:
    beam_width: int
    num_return: int  # the n best hypotheses returned, n <= beam_width
    max_tokens: int  # generated tokens at most
    stop_token_ids: frozenset[int]  # tokens that end a hypothesis (EOS unless ignored, stops)
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = EarlyStopping.HEURISTIC

    @property
    def num_candidates(self) -> int:
        """Continuations kept each step (transformers' beams_to_keep), and so the top
        log-probabilities each beam needs: enough that beam_width of them do not end, however
        many end on a stop token."""
        return max(2, 1 + len(self.stop_token_ids)) * self.beam_width


@dataclass(frozen=True, slots=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # generated, the stop token included
    score: float  # float32: sum of logprobs / len(token_ids) ** length_penalty
    stopped: bool  # ended by a stop token (else by max_tokens)


@dataclass(slots=True)
class Beam(Generic[H]):
    handle: H
    token_ids: list[int]  # generated so far
    score: float  # float32 sum of its tokens' logprobs


@dataclass(frozen=True, slots=True)
class Selection(Generic[H]):
    """What one step asks of the pool. Forks come first (children start as copies of their
    parent), then every running beam appends its token; pruned beams are freed."""

    forks: list[tuple[H, list[H]]]  # parent -> its new children
    appends: list[tuple[H, int]]    # the running beams of the next step and their new token
    pruned: list[H]                 # beams with no continuation (every beam when done)
    done: bool


@dataclass(slots=True)
class BeamSearch(Generic[H]):
    config: BeamConfig
    running: list[Beam[H]]  # best first
    finished: list[Hypothesis] = field(default_factory=list)  # best first, <= beam_width
    num_generated: int = 0  # tokens each running beam has generated
    done: bool = False

    @classmethod
    def start(cls, config: BeamConfig, handle: H) -> BeamSearch[H]:
        return cls(config, [Beam(handle, [], 0.0)])

    def select(
        self, candidates: Sequence[Sequence[tuple[int, float]]], spawn: Callable[[H], H]
    ) -> Selection[H]:
        """One step. `candidates[i]`: running beam i's most likely next tokens (at least
        num_candidates of them, or the whole vocabulary) as (token id, logprob). `spawn(parent)`
        names a new beam forked from `parent`."""
        assert not self.done, "the search is over"
        assert len(candidates) == len(self.running), "one candidate list per running beam"
        config, width = self.config, self.config.beam_width
        pool = [
            (f32(beam.score + logprob), index, token)
            for index, beam in enumerate(self.running)
            for token, logprob in candidates[index]
        ]
        # NOTE: torch.topk's order among exact ties is unspecified; the lower beam, then the
        # lower token id, first (a flattened index order).
        pool.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = pool[: config.num_candidates]
        self.num_generated += 1
        at_length = self.num_generated >= config.max_tokens
        ends = [at_length or token in config.stop_token_ids for _, _, token in top]
        self._add_finished([c for c, end in zip(top[:width], ends, strict=False) if end])
        kept = [c for c, end in zip(top, ends, strict=True) if not end][:width]
        self.done = (not kept or self._full_and_stopping() or not self._improvable(kept[0][0]))
        old = [beam.handle for beam in self.running]
        if self.done:
            self.running = []
            return Selection([], [], old, True)
        return self._advance(kept, old, spawn)

    def results(self) -> list[Hypothesis]:
        """The num_return best finished hypotheses, best first (once done)."""
        assert self.done, "the search is still running"
        return self.finished[: self.config.num_return]

    def _add_finished(self, ended: list[tuple[float, int, int]]) -> None:
        denominator = f32(float(self.num_generated) ** self.config.length_penalty)
        new = [
            Hypothesis(
                tuple(self.running[index].token_ids) + (token,), f32(score / denominator),
                token in self.config.stop_token_ids,
            )
            for score, index, token in ended
        ]
        # Stable: on equal scores the older hypothesis stays ahead (transformers concatenates
        # the finished before the new ones).
        merged = sorted([*self.finished, *new], key=lambda h: -h.score)
        self.finished = merged[: self.config.beam_width]

    def _full_and_stopping(self) -> bool:
        full = len(self.finished) == self.config.beam_width
        return full and self.config.early_stopping is EarlyStopping.WHEN_FULL

    def _improvable(self, best_running: float) -> bool:
        """transformers' early-stop heuristic: can the best running beam still beat the worst
        finished hypothesis? Always while fewer than beam_width have finished."""
        config = self.config
        length = self.num_generated
        if config.early_stopping is EarlyStopping.NEVER and config.length_penalty > 0:
            length = config.max_tokens
        best = f32(best_running / f32(float(length) ** config.length_penalty))
        if len(self.finished) < config.beam_width:
            return best > NO_SCORE  # (it is, unless scores reach -1e9)
        return best > min(h.score for h in self.finished)

    def _advance(
        self, kept: list[tuple[float, int, int]], old: list[H], spawn: Callable[[H], H]
    ) -> Selection[H]:
        """The kept continuations become the running beams: each parent's best one continues
        in the parent itself, its others in new beams forked from it."""
        continued: set[int] = set()
        children: dict[int, list[H]] = {}
        running: list[Beam[H]] = []
        appends: list[tuple[H, int]] = []
        for score, index, token in kept:
            parent = self.running[index]
            if index in continued:
                handle = spawn(parent.handle)
                children.setdefault(index, []).append(handle)
            else:
                continued.add(index)
                handle = parent.handle
            running.append(Beam(handle, [*parent.token_ids, token], score))
            appends.append((handle, token))
        forks = [(old[index], handles) for index, handles in sorted(children.items())]
        pruned = [handle for index, handle in enumerate(old) if index not in continued]
        self.running = running
        return Selection(forks, appends, pruned, False)
