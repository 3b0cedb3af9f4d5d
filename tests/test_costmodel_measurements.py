"""Published measurements as data (data/measurements/), their loader, the per-row prediction and the CLI.

Fast: loading and the roofline only (the measured backend is exercised in test_costmodel_measured.py); the
full comparison is benchmarks/costmodel_vs_published.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.steptime.measurements import load_measurements, predict, predict_with, row_replica, summarize
from mixfleet.ui.cli import app
from typer.testing import CliRunner


def test_shipped_measurements_cover_three_sources_and_the_seed_gpus() -> None:
    rows = load_measurements()
    assert len(rows) >= 40 and len({m.source for m in rows}) >= 3
    assert {m.gpu for m in rows} >= {"H100", "H200", "B200", "RTX-PRO-6000"}
    for m in rows:
        assert m.date and m.url and m.section and m.value > 0
    keys = [m.key for m in rows]
    assert len(keys) == len(set(keys))


def test_measurement_files_ship_with_the_package() -> None:
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["mixfleet.data"]
    assert "*/*.toml" in globs  # data/measurements/*.toml and data/models/*.toml are covered


def test_a_bad_row_names_file_field_and_allowed(tmp_path: Path) -> None:
    src = Path(__file__).resolve().parents[1] / "data" / "measurements" / "sglang-b200-sweep.toml"
    bad = tmp_path / "bad.toml"
    bad.write_text(src.read_text().replace('metric = "tpot_ms"', 'metric = "tokens"', 1))
    with pytest.raises(SpecError, match="metric.*tpot_ms"):
        load_measurements(bad)
    bad.write_text(src.read_text().replace('gpu = "B200"', 'gpu = "TPU"', 1))
    with pytest.raises(SpecError, match=r"bad\.toml rows\[0\]: field 'gpu' = 'TPU'.*B200"):   # file and row named
        load_measurements(bad)


def test_measurements_out_of_range_or_unpriceable_are_one_line_errors(tmp_path: Path) -> None:
    """Issue 44: concurrency = 5e9 was a 121-line OverflowError from aiconfigurator; a folder of rows none of which
    can be priced wrote an empty fit with exit 0."""
    import re

    src = Path(__file__).resolve().parents[1] / "data" / "measurements" / "sglang-b200-sweep.toml"
    big = tmp_path / "big"
    big.mkdir()
    (big / "m.toml").write_text(re.sub(r"concurrency = \d+", "concurrency = 5000000000", src.read_text(), count=1))
    res = CliRunner().invoke(app, ["calibrate", "--measurements", str(big)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "field 'concurrency' = 5000000000" in res.output and "m.toml rows[" in res.output
    none = tmp_path / "none"
    none.mkdir()
    (none / "m.toml").write_text(re.sub(r'engine = "\w+"', 'engine = "torch-reference"', src.read_text()))
    out = tmp_path / "fit.toml"
    res = CliRunner().invoke(app, ["calibrate", "--measurements", str(none), "-o", str(out)])
    assert res.exit_code == 2 and "none priceable" in res.output, res.output
    assert not out.exists()


def test_prediction_charges_prefill_to_the_same_gpus_and_uses_the_row_layout() -> None:
    rows = {m.key: m for m in load_measurements()}
    m = rows["trtllm-perf-overview#50"]  # Qwen3-235B H200 DEP4 FP8, 1000/1000, offline
    rm = row_replica(m, "roofline")
    assert (rm.tp, rm.dp_attention, rm.ep, rm.n_gpus) == (1, 4, 4, 4)
    v, c, _ = predict_with(m, rm)
    cycle = (c / 4) * float(rm.prefill_s(1000, 0)) + 1000 * float(rm.decode_step_s(c, 1500))
    assert v == pytest.approx(c * 1000 / cycle / 4)
    no_spec = predict(rows["trtllm-perf-overview#0"], "roofline")  # DeepSeek-R1: MLA, no spec
    assert no_spec.value is None and "spec" in no_spec.reason
    s = summarize([2.0, 0.5, 1.0])
    assert s["median_factor"] == 2.0 and s["worst_factor"] == 2.0 and s["median_ratio"] == pytest.approx(1.0)


def test_validate_costmodel_json_and_bad_backend() -> None:
    run = CliRunner()
    one = Path(__file__).resolve().parents[1] / "data" / "measurements" / "sglang-b200-sweep.toml"
    res = run.invoke(app, ["validate-costmodel", "--measurements", str(one), "--backends", "roofline", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["n_rows"] == 3 and rep["summary"]["roofline"]["all"]["n"] == 2
    res = run.invoke(app, ["validate-costmodel", "--backends", "magic"])
    assert res.exit_code == 2 and "aiconfigurator" in res.output


def test_calibrate_measurements_reports_leave_one_source_out() -> None:
    res = CliRunner().invoke(app, ["calibrate", "--measurements", str(Path(__file__).resolve().parents[1] / "data"
                                                                       / "measurements"), "--json"])
    assert res.exit_code == 0, res.output
    fit = json.loads(res.stdout)
    assert set(fit["per_source"]) == {"inferencemax", "sglang-b200-sweep-gist", "trtllm-perf-overview"}
    assert fit["out_of_sample"]["n"] == fit["priors_same_rows"]["n"] > 40
    fitted = [g for g in fit["groups"] if g["fitted"]]
    assert fitted and all(0 < g["eff_flops"] <= 1 and g["eff_flops_stderr"] >= 0 for g in fitted)
    assert isinstance(fit["ships"], bool)


def test_this_projects_gpu_profile_is_priced_apart_from_the_published_figures() -> None:
    """data/measurements/mixfleet-h200-decode-profile.toml (benchmarks/decode_step_profile.py on an H200): decode
    steps of this project's reference kernels. They are priced as one step at (batch, context), kept out of the
    published summaries and of the efficiency fit, and reported on their own."""
    from mixfleet.costmodel.steptime.measurements import compare

    rows = load_measurements()
    ref = [m for m in rows if not m.serving]
    assert ref and {m.engine for m in ref} == {"torch-reference"} and {m.metric for m in ref} == {"decode_step_ms"}
    assert {m.precision for m in ref} == {"bf16", "fp8"} and {m.gpu for m in ref} == {"H200"}
    m = next(x for x in ref if x.concurrency == 8 and x.isl == 4096 and x.precision == "bf16")
    rm = row_replica(m, "roofline")
    v, c, why = predict_with(m, rm)
    assert why == "" and c == 8 and v == pytest.approx(float(rm.decode_step_s(8.0, 4096.0)) * 1e3)
    big = next(x for x in ref if x.concurrency == 256 and x.isl == 4096)
    assert predict(big, "roofline").value is None              # 1M cached tokens: more than one H200's KV holds
    rep = compare(rows, ("roofline",), user=False)
    serving = compare([x for x in rows if x.serving], ("roofline",), user=False)
    assert rep["summary"]["roofline"]["all"] == serving["summary"]["roofline"]["all"]
    r = rep["summary"]["roofline"]["reference"]
    assert r["n"] + r["not_priced"] == len(ref) and r["n"] > 0
    assert r["median_ratio"] > 1                               # reference kernels: slower than the roofline says


def test_the_shipped_profile_rows_are_what_the_benchmark_makes_of_its_json() -> None:
    """The TOML is made from the benchmark's JSON by the script itself, not by hand."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("decode_step_profile", root / "benchmarks" / "decode_step_profile.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod              # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(spec.name, None)
    result = json.loads((root / "benchmarks" / "results" / "decode_step_profile_h200.json").read_text())
    text = mod.to_measurements(result, "H200")
    assert text == (root / "data" / "measurements" / "mixfleet-h200-decode-profile.toml").read_text()
    graphed = [r for r in result["rows"] if "error" not in r and r.get("cuda_graph")]
    assert text.count("[[rows]]") == len(graphed) > 0
