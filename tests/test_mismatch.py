"""`mixfleet mismatch` and `mixfleet init-model` on the tiny model: the measured mismatch against the
fp32 reference orders the precisions as their weight error does (nvfp4, mxfp4 > fp8 > bf16), the
estimators agree with each other, and the CLI prints JSON or one clear error line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mixfleet.runner.checkpoint.hf_checkpoint import load_checkpoint
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer
from mixfleet.runner.sampler.mismatch import MismatchConfig, measure_mismatch
from mixfleet.ui.cli import app
from typer.testing import CliRunner

RUNNER = CliRunner()


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ck") / "tiny"
    res = RUNNER.invoke(app, ["init-model", "tiny", "-o", str(out), "--seed", "0"])
    assert res.exit_code == 0, res.output
    return out


def test_init_model_writes_a_loadable_seeded_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    cfg, tensors = load_checkpoint(ckpt)
    assert cfg.num_hidden_layers == 4 and cfg.vocab_size == 272 and cfg.weight_version == "0"
    assert ByteTokenizer.load(ckpt).vocab_size == 272
    again = tmp_path / "again"
    assert RUNNER.invoke(app, ["init-model", "tiny", "-o", str(again), "--seed", "0"]).exit_code == 0
    other = tmp_path / "other"
    assert RUNNER.invoke(app, ["init-model", "tiny", "-o", str(other), "--seed", "1"]).exit_code == 0
    t_again, t_other = load_checkpoint(again)[1], load_checkpoint(other)[1]
    assert all(torch.equal(tensors[k], t_again[k]) for k in tensors)
    assert not torch.equal(tensors["lm_head.weight"], t_other["lm_head.weight"])


def test_mismatch_orders_precisions(ckpt: Path) -> None:
    cfg = MismatchConfig(precisions=("bf16", "fp8", "nvfp4", "mxfp4"), kv_cache_dtype="fp8_e4m3", num_prompts=6,
                         max_new_tokens=24)
    rows = {r.precision: r for r in measure_mismatch(str(ckpt), cfg)}
    for r in rows.values():
        assert r.tokens > 60 and r.kv_cache_dtype == "fp8_e4m3" and r.kernel == "bf16"
        assert r.k3 >= 0 and r.kl_exact >= 0
        assert r.share_outside_band == pytest.approx(r.share_low + r.share_high)
        assert 0 <= r.share_outside_band <= 1
        # the sampled-token estimators agree with the exact full-vocabulary KL within a factor
        assert r.kl_exact / 3 < r.k3 < 3 * r.kl_exact
    for metric in ("kl_exact", "k3"):
        v = {p: getattr(r, metric) for p, r in rows.items()}
        assert min(v["nvfp4"], v["mxfp4"]) > v["fp8"] > v["bf16"], (metric, v)
    assert rows["bf16"].top1_agreement > 0.95
    assert rows["fp8"].top1_agreement > max(rows["nvfp4"].top1_agreement, rows["mxfp4"].top1_agreement)


def test_mismatch_cli_json_and_errors(ckpt: Path) -> None:
    res = RUNNER.invoke(app, ["mismatch", "--model", str(ckpt), "--precisions", "fp32,bf16", "--kv", "fp32",
                              "--num-prompts", "2", "--max-new-tokens", "6", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [r["precision"] for r in out["rows"]] == ["fp32", "bf16"]
    assert out["rows"][0]["kernel"] == "fp32" and out["rows"][0]["tokens"] > 0
    for args, words in ((["--precisions", "bf16,fp9"], "precision 'fp9'; allowed"),
                        (["--kv", "int8"], "kv_cache_dtype 'int8'; allowed"),
                        (["--num-prompts", "0"], "num_prompts = 0"),
                        (["--max-new-tokens", "5000"], "context length")):
        bad = RUNNER.invoke(app, ["mismatch", "--model", str(ckpt), *args])
        assert bad.exit_code == 2 and words in bad.output, bad.output
    missing = RUNNER.invoke(app, ["mismatch", "--model", str(ckpt.parent / "nope")])
    assert missing.exit_code == 2 and "no config.json" in missing.output
    bad_spec = RUNNER.invoke(app, ["init-model", "huge-imaginary", "-o", str(ckpt.parent / "x")])
    assert bad_spec.exit_code == 2 and "allowed" in bad_spec.output


def test_mismatch_with_emulated_kernel_error_grows(ckpt: Path) -> None:
    base = MismatchConfig(precisions=("bf16",), kv_cache_dtype="bf16", num_prompts=3, max_new_tokens=16)
    clean = measure_mismatch(str(ckpt), base)[0]
    noisy = measure_mismatch(str(ckpt), MismatchConfig(**{**base.__dict__, "weight_noise": 0.05}))[0]
    assert (noisy.kernel, noisy.weight_noise, clean.kernel, clean.weight_noise) == ("bf16", 0.05, "bf16", 0.0)
    assert noisy.kl_exact > 10 * clean.kl_exact
    with pytest.raises(ValueError, match="kernel = 'fp16'"):
        MismatchConfig(kernel="fp16")


def test_mismatch_on_the_moe_reports_routing_disagreement(ckpt: Path, tmp_path: Path) -> None:
    """The MoE's rows carry the routing disagreement (tokens / layers whose top-k expert set differs from the
    fp32 reference's); the 4-bit format moves more tokens to other experts than bf16 does."""
    moe = tmp_path / "moe"
    assert RUNNER.invoke(app, ["init-model", "tiny-qwen3-moe", "-o", str(moe)]).exit_code == 0
    res = RUNNER.invoke(app, ["mismatch", "--model", str(moe), "--precisions", "fp32,bf16,nvfp4", "--kv", "fp32",
                              "--num-prompts", "6", "--max-new-tokens", "24", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["precision"]: r for r in json.loads(res.stdout)["rows"]}
    assert rows["fp32"]["routing_disagree_share"] == 0.0     # same weights, KV and kernel as the reference
    for r in rows.values():
        assert 0 <= r["routing_layer_share"] <= r["routing_disagree_share"] <= 1
    assert rows["nvfp4"]["routing_disagree_share"] > rows["bf16"]["routing_disagree_share"]
    table = RUNNER.invoke(app, ["mismatch", "--model", str(moe), "--precisions", "bf16", "--num-prompts", "1",
                                "--max-new-tokens", "4"])
    assert table.exit_code == 0 and "routing differs" in table.output
    dense = measure_mismatch(str(ckpt), MismatchConfig(precisions=("bf16",), num_prompts=1, max_new_tokens=4))[0]
    assert dense.routing_disagree_share is None and dense.routing_layer_share is None
