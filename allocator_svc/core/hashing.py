"""The allocator's block hashing: the profile it announces (HashProfile) and BlockHasher, the
hot-path chain hasher. The hash functions themselves are common/block_hash.py (profile
pagedkv-block-hash-v1), shared with the gateway; they are re-exported here."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from common.block_hash import (
    HASH_ALGORITHM,
    HASH_ENCODING,
    HASH_VERSION,
    BlockHash,
    hash_block,
    hash_chain,
    pack_tokens,
    root_hash,
)

__all__ = [
    "HASH_ALGORITHM", "HASH_ENCODING", "HASH_VERSION", "BlockHash", "BlockHasher",
    "HashProfile", "hash_block", "hash_chain", "hash_profile", "pack_tokens", "root_hash",
]


@dataclass(frozen=True, slots=True)
class HashProfile:
    version: str
    algorithm: str
    block_size: int
    encoding: str


def hash_profile(block_size: int) -> HashProfile:
    return HashProfile(HASH_VERSION, HASH_ALGORITHM, block_size, HASH_ENCODING)


class BlockHasher:
    """Chained hashing for one block size, packing tokens once per call (the hot path)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._stride = 4 * block_size

    def chain_with_keys(
        self, parent: BlockHash, token_ids: list[int], num_blocks: int
    ) -> tuple[list[BlockHash], list[bytes]]:
        """Hashes of the first `num_blocks` full blocks of `token_ids`, chained from `parent`,
        and each block's hash input (parent hash + packed tokens): the prefix
        cache indexes blocks by it, so a lookup of a cached block needs no hashing."""
        packed = pack_tokens(token_ids[: num_blocks * self.block_size])
        stride, sha256, hashes, keys = self._stride, hashlib.sha256, [], []
        for start in range(0, num_blocks * stride, stride):
            key = parent + packed[start : start + stride]
            parent = sha256(key).digest()
            hashes.append(parent)
            keys.append(key)
        return hashes, keys


    def next_blocks(
        self, parents: list[BlockHash], token_ids: list[int]
    ) -> tuple[list[BlockHash], list[bytes]]:
        """One block each: parents[i]'s child over the i-th block-size slice of `token_ids`
        (a decode step's filled blocks, packed in one call). Hashes and hash inputs."""
        packed, stride, sha256 = pack_tokens(token_ids), self._stride, hashlib.sha256
        keys = [parent + packed[i * stride : (i + 1) * stride] for i, parent in enumerate(parents)]
        return [sha256(key).digest() for key in keys], keys
