"""A simulated executor: the executor contract, a GPU's step times, no model, no torch.

For fleets of executors on a small machine (benchmarks of the gateway and the allocator):
the real servicer (service.py) and step validation (plan.py) over a runner whose "KV cache"
holds one digest per slot and whose steps sleep out a cost model's time.

Reading order: profiles -> token_model -> slot_cache -> model_config -> settings -> runner
-> __main__.
"""
