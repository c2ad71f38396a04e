"""Token ids for recorded requests, from their chain hashes, for a replay at any block size.

A chain hash stands for its whole prefix (cache salt included), so the tokens of recorded
block j come from hash j alone: requests whose recorded block j hashes are equal get the same
tokens for blocks 0..j, and requests that differ anywhere before get different ones. Tokens
past the last hashed block (a partial block, or blocks never committed) are the request's
own, shared with no one.

How exact: for a replayed block size that is a multiple of the recorded one, exactly (a
replayed block is shared when its last recorded block's hash is). For a divisor, a shared
prefix that ends inside a recorded block counts only up to that block's start: hits are a
lower bound, by less than one recorded block per request. Other sizes: both effects. A
recording with token ids (`--record-token-ids`) is replayed with them: exact at any size.
"""

from __future__ import annotations

from tools.replay.records import RecordedRequest


class TokenSource:
    """The token ids of a pool's requests; tokens no other request shares come from a counter
    (they may equal a hash-derived id by chance: a block matches only if all of it does)."""

    def __init__(self, recorded_block_size: int) -> None:
        self.block_size = recorded_block_size
        self.next_unique = 1

    def tokens(self, request: RecordedRequest) -> list[int]:
        """Its `num_tokens` token ids."""
        num_tokens = request.num_tokens
        if request.token_ids is not None:
            return [t if t >= 0 else self._unique(1)[0] for t in request.token_ids]
        bs = self.block_size
        num_hashed = min(request.num_hashed_blocks, num_tokens // bs)
        tokens: list[int] = []
        for index in range(num_hashed):
            value = int.from_bytes(request.block_hash(index), "little")
            high = value >> 32
            tokens.append(value & 0xFFFFFFFF)
            tokens.extend(high ^ i for i in range(1, bs))
        tokens.extend(self._unique(num_tokens - len(tokens)))
        return tokens

    def _unique(self, count: int) -> list[int]:
        start = self.next_unique
        self.next_unique += count
        return list(range(start, start + count))
