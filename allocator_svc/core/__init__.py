"""The allocator core: plain Python, no gRPC. Reading order: hashing, free_queue, cpu_blocks,
block_pool, events, pins, request, pool, step, leases, validation, hand_off, allocator."""
