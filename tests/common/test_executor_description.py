"""The executor description's one codec: what an executor reports is what the gateway reads."""

from __future__ import annotations

import dataclasses

import pytest

from common.executor_description import ExecutorDescription
from common.kv_layout import KVLayout
from pagedkv.executor.v1 import executor_pb2 as pb

pytestmark = pytest.mark.unit

LAYOUT = KVLayout("fp", 16, "float32", 2, 4, 8, 8192, "torch-kv-v1")
REPORTED = ExecutorDescription(
    instance_id="i", model_name="m", model_fingerprint="fp", num_blocks=64, block_size=16,
    num_cpu_blocks=8, backend="cpu", device="cpu", max_model_len=2048, eos_token_ids=(2, 7),
    vocab_size=512, max_num_batched_tokens=256, max_num_seqs=8, dtype="float32",
    uses_sampled_tokens=True, pool_name="pool-0", num_cpu_cache_blocks=4, role="decode",
    kv_layout=LAYOUT)


@pytest.mark.parametrize("description", [REPORTED, dataclasses.replace(REPORTED, kv_layout=None)])
def test_what_an_executor_reports_the_gateway_reads_back_whole(
    description: ExecutorDescription,
):
    wire = description.to_proto().SerializeToString()
    read = ExecutorDescription.from_proto(pb.DescribeResponse.FromString(wire))
    assert read == description
    assert pb.DescribeResponse.FromString(wire).HasField("kv_layout") == (
        description.kv_layout is not None)


def test_every_field_of_the_proto_has_a_home_in_the_record():
    # A field added to DescribeResponse and not to the record would be dropped unread.
    fields = {f.name for f in dataclasses.fields(ExecutorDescription)}
    assert fields == {f.name for f in pb.DescribeResponse.DESCRIPTOR.fields}


def test_another_executors_answer_is_read_with_the_gateways_defaults():
    # An executor that says no role serves both; a pool name past 256 characters is cut.
    msg = REPORTED.to_proto()
    msg.role = ""
    msg.pool_name = "p" * 300
    read = ExecutorDescription.from_proto(msg)
    assert (read.role, read.pool_name) == ("both", "p" * 256)
