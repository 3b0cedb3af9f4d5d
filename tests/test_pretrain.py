"""Base-policy pretraining, test-sized: a one-layer model, a few steps, a tmp cache.

Covers: packing of episodes into rows (whole episodes, segments, loss mask), the supervised loss
decreasing, the cache (same inputs -> reused without training; --force retrains; other inputs -> other
key), the checkpoint's layout (HF tensors + tokenizer + pretrain.json) and the reward measurement
with the embedded engine, plus the CLI's happy path and its error on bad input.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from mixfleet.runner.checkpoint.hf_checkpoint import load_checkpoint
from mixfleet.runner.orchestration.pretrain import (
    PAD_SEGMENT,
    PretrainConfig,
    cache_key,
    measure_reward,
    pack_episodes,
    pretrain,
)
from mixfleet.runner.rollout.demos import DemoConfig, generate_demos

MICRO_SPEC = """
name = "micro"
kind = "dense"
num_layers = 1
hidden_size = 64
num_attention_heads = 2
num_kv_heads = 1
head_dim = 32
ffn_hidden_size = 128
vocab_size = 272
max_context = 256
"""


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("spec") / "micro.toml"
    path.write_text(MICRO_SPEC)
    return str(path)


def micro_config(spec: str, **kw) -> PretrainConfig:
    base = dict(model=spec, demos=DemoConfig(num_episodes=40, seed=1), steps=12, rows_per_step=2, lr=3e-3,
                warmup_steps=0)
    base.update(kw)
    return PretrainConfig(**base)


def test_pack_episodes_keeps_episodes_whole() -> None:
    eps = generate_demos(DemoConfig(num_episodes=9, seed=3))
    rows = pack_episodes(eps, 400, random.Random(0))
    assert all(len(r["input_ids"]) == len(r["segment_ids"]) == len(r["loss_mask"]) == 400 for r in rows)
    packed = []
    for r in rows:
        segs = [s for s in dict.fromkeys(r["segment_ids"]) if s != PAD_SEGMENT]
        assert segs == list(range(len(segs)))
        for s in segs:
            idx = [i for i, x in enumerate(r["segment_ids"]) if x == s]
            assert idx == list(range(idx[0], idx[-1] + 1))
            packed.append(([r["input_ids"][i] for i in idx], [r["loss_mask"][i] for i in idx]))
        pad = [i for i, x in enumerate(r["segment_ids"]) if x == PAD_SEGMENT]
        assert all(r["loss_mask"][i] == 0 and r["input_ids"][i] == 0 for i in pad)
    assert sorted(packed) == sorted((e.tokens, e.loss_mask) for e in eps)


def test_pretrain_trains_caches_and_reuses(micro: str, tmp_path: Path) -> None:
    cfg = micro_config(micro)
    seen: list[int] = []
    demos: list[tuple[int, int]] = []
    first = pretrain(cfg, cache_dir=tmp_path, progress=lambda s, n, m: seen.append(s),
                     demo_progress=lambda d, n: demos.append((d, n)))
    assert not first.reused and seen == list(range(1, 13))
    n = cfg.demos.num_episodes                       # one call per demonstration, before the first step
    assert demos == [(d, n) for d in range(1, n + 1)]
    assert first.path == tmp_path / first.key and first.key == cache_key(cfg)
    losses = first.meta["losses"]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < 0.6 * losses[0]
    hf, tensors = load_checkpoint(first.path)
    assert hf.num_hidden_layers == 1 and hf.vocab_size == 272 and "lm_head.weight" in tensors
    assert (first.path / "tokenizer.json").exists()
    assert json.loads((first.path / "pretrain.json").read_text())["key"] == first.key
    weights = first.path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    again = pretrain(cfg, cache_dir=tmp_path, progress=lambda s, n, m: seen.append(-1))
    assert again.reused and again.path == first.path and -1 not in seen
    assert weights.stat().st_mtime_ns == mtime and again.meta["losses"] == losses

    out = tmp_path / "copy"
    forced = pretrain(cfg, cache_dir=tmp_path, force=True, out=out)
    assert not forced.reused and forced.path == out and (out / "model.safetensors").exists()
    assert forced.meta["losses"] == losses          # seeded: the same recipe trains the same curve
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == sorted([first.key, "copy"])

    assert cache_key(micro_config(micro, seed=1)) != first.key
    assert cache_key(micro_config(micro, demos=DemoConfig(num_episodes=40, seed=1, noise=0.3))) != first.key
    assert cache_key(micro_config(micro, steps=13)) != first.key

    report = measure_reward(first.path, episodes=4, precision="fp32")
    assert report.episodes == 4 and 0.0 <= report.reward <= 1.0
    assert sum(report.finish_reasons.values()) == pytest.approx(1.0)


def test_config_errors_name_the_field(micro: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pretrain.steps"):
        PretrainConfig(steps=0)
    with pytest.raises(ValueError, match="pretrain.lr"):
        PretrainConfig(lr=2.0)
    with pytest.raises(ValueError, match="demos.task: 'chess' is not one of calc, guess"):
        DemoConfig(task="chess")
    with pytest.raises(ValueError, match="demos.noise"):
        DemoConfig(noise=1.5)
    with pytest.raises(ValueError, match="row_tokens: 512 exceeds"):
        pretrain(micro_config(micro, row_tokens=512), cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def first_json(text: str) -> dict:
    return json.JSONDecoder().raw_decode(text[text.index("{"):])[0]


def test_cli_pretrain(micro: str, tmp_path: Path) -> None:
    from mixfleet.ui.cli import app
    from typer.testing import CliRunner

    runner = CliRunner()
    args = ["pretrain", "--model", micro, "--steps", "2", "--demos", "20", "--cache-dir", str(tmp_path),
            "--eval-episodes", "2", "--precision", "fp32", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    out = first_json(res.output)
    assert out["reused"] is False and out["eval"]["episodes"] == 2
    res2 = runner.invoke(app, args)
    assert res2.exit_code == 0 and first_json(res2.output)["reused"] is True
    bad = runner.invoke(app, ["pretrain", "--task", "chess", "--cache-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "demos.task: 'chess' is not one of calc, guess" in bad.output


def test_a_tasks_demonstration_format_keys_only_its_own_bases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bumping the repo demonstrations' format (demos.DEMO_FORMAT) gives repo bases a new cache key and leaves the
    keys of guess / calc bases (the ones runs record by digest) as they were."""
    from mixfleet.runner.orchestration.pretrain import PretrainConfig
    from mixfleet.runner.rollout import demos

    guess, repo = PretrainConfig(), PretrainConfig(demos=DemoConfig(task="repo"))
    before = cache_key(guess), cache_key(repo)
    monkeypatch.setitem(demos.DEMO_FORMAT, "repo", demos.DEMO_FORMAT["repo"] + 1)
    assert cache_key(guess) == before[0] and cache_key(repo) != before[1]


def test_the_optimizers_cosine_decay_schedule() -> None:
    """decay_steps: linear warmup, then a cosine from lr to 0 at decay_steps; 0 keeps the constant schedule."""
    from mixfleet.runner.trainer import OptimizerConfig

    const = OptimizerConfig(lr=1.0, warmup_steps=4)
    assert [const.lr_at(s) for s in (0, 3, 4, 100)] == [0.25, 1.0, 1.0, 1.0]
    cos = OptimizerConfig(lr=1.0, warmup_steps=4, decay_steps=12)
    assert [round(cos.lr_at(s), 6) for s in (0, 3, 4, 8, 12, 50)] == [0.25, 1.0, 1.0, 0.5, 0.0, 0.0]
    assert all(cos.lr_at(s) >= cos.lr_at(s + 1) for s in range(4, 14))
    with pytest.raises(ValueError, match="decay_steps = 4; allowed: 0 .* > warmup_steps"):
        OptimizerConfig(warmup_steps=4, decay_steps=4)


def test_a_base_goes_on_training_from_another(micro: str, tmp_path: Path) -> None:
    """init_from starts from an earlier base's weights (its key goes into the new key, its folder does not) with
    the cosine schedule; the two new settings at their defaults leave earlier bases' keys alone."""
    first = pretrain(micro_config(micro), cache_dir=tmp_path)
    assert cache_key(micro_config(micro, lr_decay=False, init_from=None)) == first.key
    from mixfleet.runner.orchestration.pretrain import base_folder

    assert base_folder(first.key, tmp_path) == str(first.path)            # a base named by its cache key
    assert base_folder(str(first.path), tmp_path / "elsewhere") == str(first.path)
    more = micro_config(micro, steps=8, lr_decay=True, init_from=str(first.path))
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(first.path, copy)
    assert cache_key(micro_config(micro, steps=8, lr_decay=True, init_from=str(copy))) == cache_key(more)
    assert cache_key(more) != cache_key(micro_config(micro, steps=8, lr_decay=True))
    second = pretrain(more, cache_dir=tmp_path)
    assert second.key != first.key and len(second.meta["losses"]) == 8
    # it starts where the first ended (its first loss is far below a fresh init's), not from scratch
    fresh = pretrain(micro_config(micro, steps=8, lr_decay=True), cache_dir=tmp_path)
    assert second.meta["losses"][0] < fresh.meta["losses"][0] - 0.3
    with pytest.raises(ValueError, match="pretrain.init_from: .* is not a base made by `mixfleet pretrain`"):
        cache_key(micro_config(micro, init_from=str(tmp_path)))
    with pytest.raises(ValueError, match="pretrain.lr_decay: needs steps"):
        micro_config(micro, steps=3, warmup_steps=5, lr_decay=True)
