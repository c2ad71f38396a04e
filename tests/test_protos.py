"""The generated protos import without path rewriting and follow the buf conventions."""

from pagedkv.allocator.v1 import allocator_pb2
from pagedkv.executor.v1 import executor_pb2
from pagedkv.gateway.v1 import gateway_pb2


def test_protos_packages_are_versioned():
    # Every package ends in a version and its services end in "Service".
    for module in (allocator_pb2, executor_pb2, gateway_pb2):
        assert module.DESCRIPTOR.package.endswith(".v1")
        for name in module.DESCRIPTOR.services_by_name:
            assert name.endswith("Service")


def test_protos_enum_zero_values_are_unspecified():
    # Enum zero values are *_UNSPECIFIED so an unset field is never a meaningful choice.
    for module in (allocator_pb2, executor_pb2, gateway_pb2):
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            assert enum.values_by_number[0].name.endswith("_UNSPECIFIED")
