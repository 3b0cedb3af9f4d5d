"""Non-finite weights never reach a sampler, and no response carries a non-finite number.

A checkpoint holding NaN / Inf is refused by `/update_weights_from_disk` (400; the old weights keep serving,
the version does not advance); the trainer refuses to export such weights (so a run stops at the diverged
update with its last saved state intact); a model whose log-probs are not finite fails `/health_generate`
and its JSON carries null, never NaN (a 500 before).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from mixfleet.runner.checkpoint.hf_checkpoint import NonFiniteWeightsError, load_checkpoint
from safetensors.torch import save_file
from sampler_helpers import make_checkpoint, served_engine


def _poisoned(src: Path, dst: Path, value: float) -> Path:
    """A copy of checkpoint `src` with one weight set to `value` (written straight with safetensors, as a
    diverged trainer or a foreign tool would)."""
    shutil.copytree(src, dst)
    _, tensors = load_checkpoint(src)
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    tensors[name][0, 0] = value
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("nonfinite")
    good = make_checkpoint(d / "v0", seed=0, weight_version="0")
    nxt = make_checkpoint(d / "v1", seed=1, weight_version="1")
    return {"good": good, "next": nxt, "nan": _poisoned(nxt, d / "nan", math.nan),
            "inf": _poisoned(nxt, d / "inf", math.inf)}


def _generate(url: str) -> httpx.Response:
    return httpx.post(f"{url}/generate", json={"input_ids": [1, 40, 41], "return_logprob": True,
                                               "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}},
                      timeout=60)


def test_update_weights_refuses_nan_and_inf_and_keeps_serving(checkpoints: dict[str, Path]) -> None:
    with served_engine(checkpoints["good"]) as (_engine, url):
        for bad in ("nan", "inf"):
            r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(checkpoints[bad]),
                                                                     "weight_version": "1"}, timeout=60)
            assert r.status_code == 400, r.text
            body = r.json()
            assert body["success"] is False and "non-finite" in body["message"] and "down_proj" in body["message"]
            assert httpx.get(f"{url}/weight_version").json()["weight_version"] == "0"
            out = _generate(url)
            assert out.status_code == 200
            lps = [t[0] for t in out.json()["meta_info"]["output_token_logprobs"]]
            assert lps and all(math.isfinite(x) for x in lps)
            assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
        ok = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(checkpoints["next"])}, timeout=60)
        assert ok.status_code == 200 and httpx.get(f"{url}/weight_version").json()["weight_version"] == "1"


def test_non_finite_log_probs_fail_health_and_are_null_in_json(checkpoints: dict[str, Path]) -> None:
    """Weights that turn non-finite in memory (not through a load, which refuses them): /generate answers
    valid JSON (null log-probs) instead of a 500, and /health_generate goes red."""
    with served_engine(checkpoints["good"]) as (engine, url):
        engine._weights.norm.fill_(math.nan)             # every hidden state becomes NaN
        out = _generate(url)
        assert out.status_code == 200, out.text
        assert "NaN" not in out.text and "Infinity" not in out.text
        lps = [t[0] for t in json.loads(out.text)["meta_info"]["output_token_logprobs"]]
        assert lps and all(x is None for x in lps)
        stream = httpx.post(f"{url}/generate", json={"input_ids": [1, 40], "return_logprob": True, "stream": True,
                                                     "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert stream.status_code == 200 and "NaN" not in stream.text
        assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 503


def test_trainer_refuses_to_export_non_finite_weights(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from mixfleet.runner.trainer import Trainer

    trainer = Trainer.from_checkpoint(checkpoints["good"])
    trainer.export_hf(tmp_path / "ok", 0)                      # finite: exported
    with torch.no_grad():
        next(p for n, p in trainer.model.named_parameters() if "weight" in n).view(-1)[0] = math.inf
    with pytest.raises(NonFiniteWeightsError, match="version 3 are not finite.*resume"):
        trainer.export_hf(tmp_path / "bad", 3)
    assert not (tmp_path / "bad").exists()
    assert load_checkpoint(tmp_path / "ok")[0].weight_version == "0"
