"""What one block of an executor's KV is, byte for byte (the executor proto's KVLayout): two
executors may move KV (a hand-off) only when theirs are equal. Shared by the executors, which
report and check it, and the gateway, which picks hand-off targets by it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The proto's KVLayout, fields in its order."""

    model_fingerprint: str
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_block: int
    format: str  # the executor kind's byte encoding, e.g. "torch-kv-v1"
