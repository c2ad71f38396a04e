"""The gateway: public API, tokenizer, scheduler and routing over the allocator and executors."""
