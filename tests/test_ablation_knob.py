"""The ablation study's pieces that need no run: the mismatch knob (the engine's emulated kernel error), the
variants (only the loss differs), the study's configuration and run layout, and the CLI's input errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import typer
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.policies.plan import load_plan
from mixfleet.runner.checkpoint.init_model import init_model
from mixfleet.runner.orchestration.fleet import fleet_from_plan
from mixfleet.runner.sampler.engine import Engine, EngineConfig
from mixfleet.runner.sampler.engine.model import load_weights, perturb
from mixfleet.runner.sampler.mismatch import MismatchConfig, _generate, prompts, score
from mixfleet.studies.ablation import (
    VARIANT_KEYS,
    VARIANTS,
    AblationConfig,
    fleets_for,
    run_ablation,
    run_specs,
    variant,
    variant_plan,
)
from mixfleet.ui.commands import experiment
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(init_model(load_model_spec("tiny"), tmp_path_factory.mktemp("init") / "m", seed=0))


# ---- the knob ------------------------------------------------------------------------------------------------
def test_perturb_is_a_fixed_relative_pattern() -> None:
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    assert perturb(w, 0.0, 3, "x") is w
    a, b = perturb(w, 0.3, 3, "x"), perturb(w, 0.3, 3, "x")
    assert torch.equal(a, b)                                              # same seed and name: same pattern
    assert not torch.equal(a, perturb(w, 0.3, 3, "y"))                    # per tensor name
    assert not torch.equal(a, perturb(w, 0.3, 4, "x"))                    # per seed
    rel = (a / w - 1.0).std().item()
    assert 0.28 < rel < 0.32                                              # 131072 draws of N(0, 0.3^2)


def test_noise_zero_keeps_the_weights_bitwise(ckpt: Path) -> None:
    base = load_weights(ckpt, precision="nvfp4", kernel="bf16")
    off = load_weights(ckpt, precision="nvfp4", kernel="bf16", weight_noise=0.0, noise_seed=7)
    on = load_weights(ckpt, precision="nvfp4", kernel="bf16", weight_noise=0.2, noise_seed=7)
    assert torch.equal(base.layers[0].wqkv, off.layers[0].wqkv) and torch.equal(base.lm_head, off.lm_head)
    assert not torch.equal(base.layers[0].wqkv, on.layers[0].wqkv) and not torch.equal(base.lm_head, on.lm_head)
    assert torch.equal(base.embed, on.embed)                              # embeddings and norms untouched


def test_noise_is_its_own_setting_and_the_old_kernel_spelling_is_refused() -> None:
    c = EngineConfig(kernel="bf16", weight_noise=0.3)
    assert (c.kernel, c.weight_noise, c.kernel_dtype) == ("bf16", 0.3, "bf16")
    assert EngineConfig().weight_noise == 0.0
    for old in ("bf16+noise0.3", "+noise0.1"):       # the retired spelling names the new setting
        with pytest.raises(ValueError, match="weight_noise=0.[13]"):
            EngineConfig(kernel=old)
    for bad, field in (({"kernel": "bf16+noiseX"}, "kernel"), ({"kernel": "fp16"}, "kernel"),
                       ({"weight_noise": -0.1}, "weight_noise"),
                       ({"precision": "fp8", "fp8_scaled_mm": True, "weight_noise": 0.1}, "weight_noise")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**bad)


def test_noise_raises_the_measured_mismatch(ckpt: Path) -> None:
    ref = load_weights(ckpt, precision="fp32", kernel="fp32")
    cfg = MismatchConfig(precisions=("bf16",), kv_cache_dtype="bf16", num_prompts=2, max_new_tokens=12)
    k3 = {}
    for noise in (0.0, 0.3):
        e = Engine(ckpt, precision="bf16", kv_cache_dtype="bf16", kernel="bf16", weight_noise=noise, seed=0)
        ids = prompts(e.tokenizer, 2)
        k3[noise] = score(ref, e.weights, "bf16", ids, _generate(e, ids, cfg), 1.0)["k3"]
        assert e.server_info()["weight_noise"] == noise
    assert k3[0.3] > 10 * k3[0.0]


# ---- variants and the study's layout ------------------------------------------------------------------------
def test_six_variants_differ_only_in_the_loss() -> None:
    assert [v.label for v in VARIANTS] == ["GRPO", "GRPO+MIS", "SC", "GRPO+top-p", "SC+MIS", "SC+MIS+top-p"]
    base = load_plan("ablation-mixed")
    plans = {k: variant_plan(base, k, 3).to_dict() for k in VARIANT_KEYS}
    rest = []
    for k, d in plans.items():
        t = d.pop("trainer")
        v = variant(k)
        assert (t["loss"], t["top_p"] < 1.0, t["top_p_replay"]) == (v.loss, v.top_p, v.top_p)
        assert d.pop("name") == f"ablation-mixed-{k}-s3" and d["seed"] == 3
        rest.append((d, {f: x for f, x in t.items() if f not in ("loss", "top_p", "top_p_replay")}))
    assert all(r == rest[0] for r in rest)
    assert variant("SC+MIS").key == "sc_mis"
    with pytest.raises(ValueError, match="allowed: grpo, grpo_mis"):
        variant("ppo")


def test_fleet_plans_ship_the_knob() -> None:
    mixed, homo = load_plan("ablation-mixed"), load_plan("ablation-homogeneous")
    assert {g.precision for g in mixed.groups} == {"bf16", "fp8", "nvfp4"}
    assert [g.weight_noise for g in mixed.groups] == [0.0, 0.3, 0.6]
    assert [g.weight_noise for g in fleet_from_plan(mixed).groups] == [0.0, 0.3, 0.6]   # what the samplers get
    assert [(g.precision, g.kernel, g.kv_dtype) for g in homo.groups] == [("bf16", "bf16", "bf16")]
    assert sum(g.replicas for g in homo.groups) == sum(g.replicas for g in mixed.groups) == 3
    assert homo.policies.batcher.settings == mixed.policies.batcher.settings
    assert homo.embedded.max_turns == mixed.embedded.max_turns


def test_config_validation_and_layout(tmp_path: Path) -> None:
    cfg = AblationConfig(out_dir=tmp_path, fleets=fleets_for("both"), variants=("grpo", "SC+MIS"), seeds=(0, 1))
    assert cfg.variants == ("grpo", "sc_mis")
    names = [s.name for s in run_specs(cfg)]
    assert names[:4] == ["mixed/grpo/seed0", "mixed/sc_mis/seed0", "homogeneous/grpo/seed0",
                         "homogeneous/sc_mis/seed0"] and len(names) == 8
    assert run_specs(cfg)[0].out_dir == tmp_path / "mixed" / "grpo" / "seed0"
    for bad, field in (({"fleets": ("gpu",)}, "fleets"), ({"seeds": (0, 0)}, "seeds"), ({"updates": 0}, "updates"),
                       ({"variants": ("ppo",)}, "variant"), ({"parallel": 0}, "parallel"), ({"lr": 2.0}, "lr"),
                       ({"plans": {"gpu": "x"}}, "plans")):
        with pytest.raises(ValueError, match=field):
            AblationConfig(out_dir=tmp_path, **bad)
    with pytest.raises(ValueError, match="fleet"):
        fleets_for("all")
    assert fleets_for("moe") == ("mixed-moe", "mixed-moe-replay")
    moe, replay = load_plan("ablation-mixed-moe"), load_plan("ablation-mixed-moe-replay")
    assert (moe.model, moe.trainer.routing, replay.trainer.routing) == ("tiny-qwen3-moe", "free", "replay")
    assert [g.weight_noise for g in moe.groups] == [0.0, 0.3, 0.6]


def test_refuses_a_bad_base_policy_before_starting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="base_policy"):
        run_ablation(AblationConfig(out_dir=tmp_path / "s", base_policy=str(tmp_path)), log=lambda _: None)
    assert not (tmp_path / "s").exists()


def test_cli_input_errors(tmp_path: Path) -> None:
    app = typer.Typer()
    experiment.register(app)
    for args, text in ((["--fleet", "gpu"], "allowed: mixed, homogeneous, both"),
                       (["--seeds", "x"], "--seeds"), (["--seeds", "0"], "one seed alone: '0,'"),
                       (["--variants", "ppo"], "allowed: grpo"),
                       (["--init", str(tmp_path)], "base_policy")):
        r = CliRunner().invoke(app, ["experiment", "ablation", "--out", str(tmp_path / "o"), *args])
        assert r.exit_code == 2, r.output
        assert text in r.output and "Traceback" not in r.output
