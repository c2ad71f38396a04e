"""The allocator core: plain Python, no gRPC. Reading order: hashing, free_queue, block_pool,
events, pins, request, pool, step, leases, validation, allocator."""
