"""Golden vectors: any component can reproduce a block hash bit for bit from the profile."""

import hashlib
import struct

from allocator_svc.core.hashing import hash_block, hash_chain, hash_profile, root_hash

# Golden vectors for pagedkv-block-hash-v1 (fingerprint "tiny-llama", block size 16).
ROOT_NO_SALT = "3a608d9048f71914ae4105f8148a070c7a96bcdaf33cd43e4d8f6cdf74da0d18"
ROOT_TENANT_A = "8da59851475e0d6841cedc0d076590b04cd710fb6c7bd191c2c3ac343318600d"
BLOCK0_RANGE16 = "2abb63ad2762eb68d4220e009e66b8f2093888d8b76ecd67a9a1b312b0cdc70b"
BLOCK1_RANGE16_32 = "a03bdf4a7b808f1a0991aea942d26f96f0af199bec36ea299006f3e91c40ca41"


def test_hashing_root_matches_golden_vectors():
    # Roots bind the model fingerprint and the cache salt.
    assert root_hash("tiny-llama", "").hex() == ROOT_NO_SALT
    assert root_hash("tiny-llama", "tenant-a").hex() == ROOT_TENANT_A


def test_hashing_chain_matches_golden_vectors():
    # Only the two full blocks of 40 tokens are hashed, each chained to its parent.
    chain = hash_chain(root_hash("tiny-llama", ""), list(range(40)), 16)
    assert [h.hex() for h in chain] == [BLOCK0_RANGE16, BLOCK1_RANGE16_32]


def test_hashing_encoding_is_reproducible_from_its_description():
    # An independent implementation written from the profile's text gives the same bytes.
    fp, salt = b"tiny-llama", b"tenant-a"
    root = hashlib.sha256(
        b"pagedkv-block-hash-v1\x00"
        + len(fp).to_bytes(4, "little")
        + fp
        + len(salt).to_bytes(4, "little")
        + salt
    ).digest()
    tokens = [5, 70000, 2**32 - 1, 0]
    expected = hashlib.sha256(root + b"".join(struct.pack("<I", t) for t in tokens)).digest()
    assert hash_block(root_hash("tiny-llama", "tenant-a"), tokens) == expected


def test_hashing_salt_and_fingerprint_separate_chains():
    # Same tokens under another salt or model never collide.
    tokens = list(range(16))
    base = hash_block(root_hash("m", ""), tokens)
    assert hash_block(root_hash("m", "s"), tokens) != base
    assert hash_block(root_hash("m2", ""), tokens) != base
    # Length prefixes keep ("ab", "") and ("a", "b") apart.
    assert root_hash("ab", "") != root_hash("a", "b")


def test_hashing_profile_names_version_and_block_size():
    profile = hash_profile(32)
    assert (profile.version, profile.algorithm, profile.block_size) == (
        "pagedkv-block-hash-v1",
        "sha256",
        32,
    )


def test_hashing_fast_chain_equals_reference_chain():
    # The packed hot-path hasher and the pool's cache entries agree with the reference.
    from allocator_svc.core.hashing import BlockHasher
    from tests.allocator.conftest import make_harness, new

    root = root_hash("fp", "")
    tokens = list(range(1000, 1040))
    assert BlockHasher(4).chain_with_keys(root, tokens, 10)[0] == hash_chain(root, tokens, 4)
    h = make_harness(num_blocks=16, block_size=4)
    h.step([new("a", tokens)])
    h.step([], commits={"a": 40})
    assert set(h.pool.blocks.cached) == set(hash_chain(root, tokens, 4))


def test_prefix_lookup_of_a_prompt_never_seen_and_of_a_first_block_hit():
    # A miss at the first block finds nothing; a first-block hit goes on down the chain.
    from tests.allocator.conftest import make_harness, new

    h = make_harness(num_blocks=16, block_size=4)
    tokens = list(range(100, 116))
    h.step([new("a", tokens)])
    h.step([], commits={"a": 16})
    pool, root = h.pool, h.pool.root("")
    assert pool.match_prefix(root, list(range(500, 516))) == ([], [])
    hits, hashes = pool.match_prefix(root, tokens[:8] + [1, 2, 3, 4, 5])
    assert hashes == hash_chain(root, tokens[:8], 4) and len(hits) == 2
    hits, hashes = pool.match_prefix(root, tokens + [7])
    assert hashes == hash_chain(root, tokens, 4) and len(hits) == 4
    assert pool.match_prefix(root, tokens[:4]) == ([], [])  # the last token is recomputed
