"""The executor service: model weights, the paged KV cache, attention backends and sampling.

Reading order: settings -> model_loader -> kv_cache -> attention/ -> step -> plan -> sampler
-> runner -> convert -> service -> __main__.
"""
