"""`mixfleet catalog` and `mixfleet capacity` through typer's CliRunner: tables, JSON, exit code 2 on bad input."""

from __future__ import annotations

import json

import pytest
from mixfleet.ui.cli import app
from typer.testing import CliRunner

RUN = CliRunner()


def test_catalog_json_parses_and_ranks_six_gpus() -> None:
    res = RUN.invoke(app, ["catalog", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["model"] == "qwen3.6-35b-a3b" and rep["price_table"] == "modal"
    assert len(rep["ranking"]) == 6
    assert {(x["accelerator"], x["precision"]) for x in rep["needs_tp"]} >= {("H100", "bf16"), ("A100-80GB", "bf16")}


def test_catalog_table_and_runpod_prices() -> None:
    res = RUN.invoke(app, ["catalog", "--price-table", "runpod", "--batches", "1,64"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "ranked by their best $/Mtoken" in res.stdout and "runpod" in res.stdout
    assert "Need TP > 1" in res.stdout and "H100-bf16 (TP 2)" in res.stdout


def test_capacity_json_and_tiny_on_cpu() -> None:
    res = RUN.invoke(app, ["capacity", "-a", "H100", "-q", "fp8", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["tp"] == 1 and rep["kv_capacity_tokens"] > 0 and rep["grid"]
    res = RUN.invoke(app, ["capacity", "-m", "tiny", "-a", "CPU-2core", "-q", "fp32", "--kv-dtype", "fp32"],
                     env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "KV capacity" in res.stdout


@pytest.mark.parametrize("args,needle", [
    (["catalog", "--model", "nope"], "'tiny'"),
    (["catalog", "--price-table", "aws"], "'runpod'"),
    (["catalog", "--precisions", "int3"], "'nvfp4'"),
    (["catalog", "--batches", "0,x"], "--batches"),
    (["capacity", "-a", "TPU", "-q", "bf16"], "'B200'"),
    (["capacity", "-a", "H100", "-q", "nvfp4"], "--emulated"),
    (["capacity", "-a", "H100", "-q", "bf16", "--tp", "1"], "GB usable per GPU"),
])
def test_bad_input_exits_2_with_a_clear_message(args: list[str], needle: str) -> None:
    res = RUN.invoke(app, args)
    assert res.exit_code == 2
    assert needle in res.output and "Traceback" not in res.output


def test_emulated_flag_allows_emulation() -> None:
    res = RUN.invoke(app, ["capacity", "-a", "H100", "-q", "nvfp4", "--emulated", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["emulated"] is True
