"""The allocator and the executors as the engines call them: typed calls, their failures as
outcomes (call_failures), the gateway's lease, one pool's link."""
