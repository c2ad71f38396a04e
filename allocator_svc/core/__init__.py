"""The allocator core: plain Python, no gRPC. Reading order: hashing, free_queue, block_pool,
events, request, kv_manager, step, leases, allocator."""
