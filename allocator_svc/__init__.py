"""The block-allocator service: KV block pools, prefix cache and block tables for executors."""
