"""mixfleet's embedded sampler engine (torch): `Engine` implements `runner/engine_api.SamplerEngine`.

model.py (the forward, weight loading), quant.py (weight formats), kvcache.py (KV slots, KV dtypes),
sampling.py (batched sampling and its records), engine.py (scheduling, control, weight updates).
"""

from mixfleet.runner.sampler.engine.engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig"]
