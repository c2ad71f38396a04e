"""Chained block hashing over a canonical byte encoding (profile pagedkv-block-hash-v1).

    root     = SHA-256( b"pagedkv-block-hash-v1\\0"
                        || u32le(len(fingerprint)) || fingerprint (UTF-8)
                        || u32le(len(cache_salt))  || cache_salt (UTF-8) )
    block[i] = SHA-256( parent || u32le(token_0) || ... || u32le(token_{block_size-1}) )
    parent   = block[i-1], or root for i = 0

The extra keys (model fingerprint, cache salt) enter once, through the root: every block hash
of a chain depends on them, so two salts or two models never share a block. Only full blocks
are hashed. Python's hash() is never used (it is salted per process).

Shared: the allocator keys its prefix cache by these hashes (allocator_svc/core/hashing.py adds
its hot-path hasher), and the gateway's approximate prefix index (--routing approx) hashes
prompts itself to match them against the allocator's cache events.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array

HASH_VERSION = "pagedkv-block-hash-v1"
HASH_ALGORITHM = "sha256"
HASH_ENCODING = (
    "root = sha256(b'pagedkv-block-hash-v1\\x00' + u32le(len(fp)) + fp + u32le(len(salt)) + salt)"
    " with fp = model fingerprint and salt = cache_salt in UTF-8; "
    "block_i = sha256(parent + u32le(token) for each of the block_size token ids), "
    "parent = block_{i-1} or root"
)

BlockHash = bytes


def _length_prefixed(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def root_hash(model_fingerprint: str, cache_salt: str) -> BlockHash:
    """The parent of a chain's first block: binds the model and the tenant's salt."""
    seed = HASH_VERSION.encode() + b"\x00"
    return hashlib.sha256(
        seed + _length_prefixed(model_fingerprint) + _length_prefixed(cache_salt)
    ).digest()


def hash_block(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    """Hash one full block given its parent's hash."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def pack_tokens(token_ids: list[int]) -> bytes:
    """u32le of each token id, as the profile's encoding says."""
    packed = array("I", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def hash_chain(root: BlockHash, token_ids: list[int], block_size: int) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (reference helper for other components)."""
    hashes: list[BlockHash] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
