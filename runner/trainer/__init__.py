"""The Megatron-core RL trainer (runner item 1): model build, HF export/import, the Trainer class.

Imports are lazy so that `mixfleet.runner.trainer.hf_export` (pure torch) can be used without
loading Megatron-core. Public names: Trainer, TrainerConfig, OptimizerConfig, BuildOptions,
ensure_parallel_state, build_gpt_model, megatron_to_hf, hf_to_megatron, policy_loss_fn, OutputLayerLoss.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Trainer": "trainer", "TrainerConfig": "trainer", "OptimizerConfig": "trainer", "LossFn": "trainer",
    "spec_from_hf_config": "trainer", "policy_loss_fn": "trainer", "OutputLayerLoss": "trainer",
    "BuildOptions": "megatron_model", "BuiltModel": "megatron_model",
    "ensure_parallel_state": "megatron_model", "build_gpt_model": "megatron_model",
    "padded_vocab_size": "megatron_model", "megatron_to_hf": "hf_export", "hf_to_megatron": "hf_export",
    "split_qkv": "hf_export", "fuse_qkv": "hf_export",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
