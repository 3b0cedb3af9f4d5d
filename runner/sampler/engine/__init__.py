"""mixfleet's embedded sampler engine (torch): `Engine` implements `runner/engine_api.SamplerEngine`.

model.py (the forward, weight loading), quant.py (weight formats), kvcache.py (KV slots, KV dtypes),
sampling.py (batched sampling and its records), engine.py (scheduling, control, weight updates), config.py
(`EngineConfig`: the engine's settings).
"""

from mixfleet.runner.sampler.engine.config import EngineConfig
from mixfleet.runner.sampler.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]
