"""The simulated model: a fixed next-token distribution keyed by a digest of the tokens so far.

The simulated KV cache holds, in each slot, the digest of every token up to and including
that position:

    d[-1] = ROOT_DIGEST        d[p] = extend(d[p - 1], token[p], p)

so the slot a step reads (position start_position - 1, through the block table) stands for
the whole prefix, as a real K/V does for attention: equal prefixes continue equally (prefix
caching, forks), and a block table that points at the wrong blocks gives other tokens, as a
real model would. One slot read per sequence and one digest per token: O(1) per token.

After a sequence whose last digest is d, the logits are: `num_candidates` distinct token ids
drawn from d (candidate j has logit -j * CANDIDATE_STEP, so candidate 0 is the argmax), every
other id BASE_LOGIT, and the EOS ids -inf. Greedy picks candidate 0: the EOS ids are never
sampled, so an output ends at its max_tokens (or a stop string), never early. The logprobs
are the exact log-softmax of these logits (the same for every context), and the top
logprobs are the first candidates: what a caller asking for them gets from a real model.
The ids are splitmix64 (Steele et al., 2014) finalised digests: spelled out here, so that
the tokens are the same on every Python, in the executor and in the conformance reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MASK = (1 << 64) - 1
ROOT_DIGEST = 0x9E3779B97F4A7C15  # the digest before position 0
_GOLDEN = 0x9E3779B97F4A7C15
_POSITION = 0xD1B54A32D192ED03
MAX_CANDIDATES = 20  # the contract's top_logprobs bound
CANDIDATE_STEP = 0.5  # logit gap between neighbouring candidates
BASE_LOGIT = -16.0  # every id that is neither a candidate nor EOS


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints that spreads every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def extend(digest: int, token_id: int, position: int) -> int:
    """The digest of a prefix one token longer: `token_id` at `position`."""
    return _mix((digest + (token_id + 1) * _GOLDEN + position * _POSITION) & MASK)


def digest_of(token_ids: list[int] | tuple[int, ...]) -> int:
    """The digest of a whole sequence from position 0 (tests, the conformance reference)."""
    digest = ROOT_DIGEST
    for position, token_id in enumerate(token_ids):
        digest = extend(digest, token_id, position)
    return digest


@dataclass(frozen=True, slots=True)
class TokenModel:
    vocab_size: int
    eos_token_ids: frozenset[int]  # never sampled (logit -inf)
    num_candidates: int = field(init=False)
    log_normaliser: float = field(init=False)  # log of the softmax's sum: the same everywhere

    def __post_init__(self) -> None:
        eligible = self.vocab_size - len({t for t in self.eos_token_ids if t < self.vocab_size})
        assert eligible > 0, f"a vocabulary of {self.vocab_size} ids, all EOS, cannot sample"
        num_candidates = min(MAX_CANDIDATES, eligible)
        total = sum(math.exp(-j * CANDIDATE_STEP) for j in range(num_candidates))
        total += (eligible - num_candidates) * math.exp(BASE_LOGIT)
        object.__setattr__(self, "num_candidates", num_candidates)
        object.__setattr__(self, "log_normaliser", math.log(total))

    def _draw(self, digest: int, index: int) -> int:
        return _mix((digest + (index + 1) * _GOLDEN) & MASK) % self.vocab_size

    def next_token(self, digest: int) -> int:
        """The argmax after a sequence whose last digest is `digest`: candidate 0."""
        index = 0
        while (token_id := self._draw(digest, index)) in self.eos_token_ids:
            index += 1
        return token_id

    def candidates(self, digest: int, k: int) -> tuple[int, ...]:
        """The k most likely ids, most likely first (k <= num_candidates)."""
        assert k <= self.num_candidates, f"only {self.num_candidates} candidates, asked {k}"
        chosen: dict[int, None] = {}
        index = 0
        while len(chosen) < k:
            token_id = self._draw(digest, index)
            if token_id not in self.eos_token_ids:
                chosen.setdefault(token_id)
            index += 1
        return tuple(chosen)

    def logprob(self, rank: int) -> float:
        """The log-probability of the `rank`-th candidate (0: the argmax)."""
        return -rank * CANDIDATE_STEP - self.log_normaliser

    def token_logprob(self, digest: int, token_id: int) -> tuple[float, int]:
        """`token_id`'s log-probability after `digest`, and its rank (1 + the ids more likely)."""
        candidates = self.candidates(digest, self.num_candidates)
        if token_id in candidates:
            rank = candidates.index(token_id)
            return self.logprob(rank), rank + 1
        if token_id in self.eos_token_ids:
            return -math.inf, self.vocab_size
        return BASE_LOGIT - self.log_normaliser, self.num_candidates + 1

    def top_logprobs(self, digest: int, k: int) -> tuple[tuple[int, float], ...]:
        ids = self.candidates(digest, min(k, self.num_candidates))
        return tuple((token_id, self.logprob(rank)) for rank, token_id in enumerate(ids))

    def logits(self, digest: int) -> list[float]:
        """The whole row, [V] (tests and the conformance reference; the executor never
        builds it)."""
        row = [BASE_LOGIT] * self.vocab_size
        for token_id in self.eos_token_ids:
            if token_id < self.vocab_size:
                row[token_id] = -math.inf
        for rank, token_id in enumerate(self.candidates(digest, self.num_candidates)):
            row[token_id] = -rank * CANDIDATE_STEP
        return row

    def generate(self, prompt: list[int] | tuple[int, ...], num_new: int) -> list[int]:
        """Greedy continuation of `prompt` (the reference the tests compare against)."""
        digest, out = digest_of(prompt), []
        for position in range(len(prompt), len(prompt) + num_new):
            token_id = self.next_token(digest)
            out.append(token_id)
            digest = extend(digest, token_id, position)
        return out
