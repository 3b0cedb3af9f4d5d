"""The test-sized real-run plans (tiny model, workload tiny-cpu, CPU embedded samplers) of the run tests,
built from one set of parts so each test says only what its run needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w

CPU_BF16 = {"name": "cpu-bf16", "accelerator": "CPU-2core", "precision": "bf16", "kv_dtype": "bf16",
            "kernel": "fp32", "emulated": True}
CPU_FP8 = {"name": "cpu-fp8", "accelerator": "CPU-2core", "precision": "fp8", "kv_dtype": "fp8_e4m3",
           "emulated": True}
CPU_NVFP4 = {"name": "cpu-nvfp4", "accelerator": "CPU-2core", "precision": "nvfp4", "kv_dtype": "fp8_e4m3",
             "emulated": True}
FIXED_EVERY_1S = {"name": "fixed", "interval_s": 1.0}     # the autoscaler: replace a lost replica within ~1 s


def run_plan_toml(name: str, groups: list[dict[str, Any]], *, batcher: dict[str, Any], embedded: dict[str, Any],
                  model: str = "tiny", trainer: dict[str, Any] | None = None,
                  autoscaler: dict[str, Any] | None = None, weight_sync: dict[str, Any] | None = None) -> str:
    """A plan's TOML: a 1-GPU CPU-2core trainer (with `trainer`'s settings) and `groups` (each a dict, e.g.
    `{**CPU_BF16, "replicas": 2}`), the given policies and `[embedded]` settings."""
    policies: dict[str, Any] = {}
    if autoscaler is not None:
        policies["autoscaler"] = autoscaler
    policies["batcher"] = batcher
    if weight_sync is not None:
        policies["weight_sync"] = weight_sync
    return tomli_w.dumps({"name": name, "model": model, "workload": "tiny-cpu",
                          "trainer": {"accelerator": "CPU-2core", "gpus": 1, **(trainer or {})},
                          "groups": groups, "policies": policies, "embedded": embedded})


def run_files(root: Path, plan_toml: str, model: str = "tiny") -> tuple[Path, Path]:
    """A test run's inputs under `root`: the base checkpoint (`init_model` of `model`, seed 0) and the plan file."""
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.runner.checkpoint.init_model import init_model

    init = init_model(load_model_spec(model), root / "init", seed=0)
    plan_path = root / "plan.toml"
    plan_path.write_text(plan_toml)
    return Path(init), plan_path
