"""The Streamlit app driven in-process by Streamlit's AppTest: every page renders with its defaults,
the planner runs and shows a mix, bad plan uploads show the validation error (never a traceback), the
Dry-run page simulates two plans, and the Runs page charts run logs made here by the twin and by
RunLogWriter (a "runner" run of the same plan, overlaid with the twin's prediction). `mixfleet ui` serves
headless on loopback, and a SIGTERM to it stops its Streamlit child (slow: the real command). An uploaded plan
naming a TOML file elsewhere shows none of its values on the Dry-run page.

Kept quick: dry runs use the tiny-cpu workload and 2 updates (MIXFLEET_UI_UPDATES / MIXFLEET_UI_WORKLOAD).
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("streamlit.testing.v1")
from mixfleet.costmodel.records.runlog import GroupRecord, RunLog, RunLogWriter, UpdateRecord  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402
from trust_helpers import SECRET, plan_text  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")
TIMEOUT_S = 240
UPDATES = 2


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    monkeypatch.setenv("MIXFLEET_UI_UPDATES", str(UPDATES))
    monkeypatch.setenv("MIXFLEET_UI_WORKLOAD", "tiny-cpu")
    return runs


def _app(page: str | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    if page is not None:
        at.switch_page(page)
        at.run()
        assert not at.exception, [e.value for e in at.exception]
    return at


def _plotly_titles(at: AppTest) -> list[str]:
    out = []
    for el in at.get("plotly_chart"):
        fig = json.loads(el.proto.spec)
        title = fig.get("layout", {}).get("title", {})
        out.append(title.get("text", "") if isinstance(title, dict) else str(title))
    return out


def _texts(at: AppTest) -> str:
    parts = [e.value for kind in ("markdown", "caption", "info", "warning", "error", "success") for e in at.get(kind)]
    return "\n".join(str(p) for p in parts)


@pytest.fixture(scope="module")
def twin_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A dry run of the seed's mixed fleet on the tiny workload, made by the twin, in a runs folder."""
    from mixfleet.twin.sim import simulate
    from mixfleet.ui.app_common import plan_object, shipped_plan, with_workload

    runs = tmp_path_factory.mktemp("twin-runs")
    plan = plan_object(with_workload(shipped_plan("seed-mixed"), "tiny-cpu"))
    simulate(plan, updates=3, seed=0, out=runs / "twin-tiny")
    return runs, plan.to_dict()


def _runner_log(folder: Path, plan: dict, updates: int = 3, status_running: bool = False) -> None:
    """A "runner" run log of the same plan, written record by record (numbers chosen here)."""
    groups = [g["name"] for g in plan["groups"]]
    w = RunLogWriter(folder, {"source": "runner", "plan": plan, "seed": 0}, flush_every_s=None)
    for v in range(1, updates + 1):
        w.append(UpdateRecord(version=v, start_s=10.0 * v - 2, end_s=10.0 * v, train_step_s=1.5, weight_sync_s=0.5,
                              tokens=1000 + v, trajectories=128, staleness_mean=0.5 * v, staleness_p50=0.0,
                              staleness_p95=1.0, staleness_max=2, cost_sampler_usd=0.5 * v, cost_trainer_usd=0.1 * v,
                              kl_k3=0.01 * v, extreme_low_share=0.001, extreme_high_share=0.002,
                              entropy=2.0 - 0.1 * v, grad_norm=1.0 + v, loss=0.1, reward_mean=0.2 + 0.1 * v))
        for i, g in enumerate(groups):
            w.append(GroupRecord(version=v, group=g, replicas_up=1.0, utilization=0.9, tokens_generated=500 + i,
                                 samples=16, share_of_samples=1 / len(groups), kl_k3=0.001 * (i + 1),
                                 extreme_share=0.0005 * (i + 1), cost_usd=0.05, tokens_trained=120,
                                 routing_token_share=0.1 * (i + 1), routing_layer_share=0.03 * (i + 1)))
    w.flush()
    if status_running:
        return  # left open: the header says "running"
    w.close()


def test_app_opens_on_the_plan_page_with_three_pages(env: Path) -> None:
    at = _app()
    assert [t.value for t in at.title] == ["Plan"]


def test_planner_runs_with_the_defaults_and_shows_a_mix(env: Path) -> None:
    at = _app()
    assert not at.warning, [w.value for w in at.warning]  # the planner is available
    at.button(key="pl_go").click()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert "Chosen mix" in [s.value for s in at.subheader]
    assert any("The twin's steady state" in m.value for m in at.markdown)
    steady = [(m.label, m.value) for m in at.metric if " ± " in m.value]      # the twin's, with intervals
    assert {"time per update", "cost per update", "mean staleness (versions)"} <= {k for k, _ in steady}, steady
    mix = at.table[0].value
    assert len(mix) >= 1 and (mix["replicas"].astype(int) >= 1).all()
    assert set(mix["accelerator"]) <= {"B200", "B300", "H200", "H100", "A100-80GB", "RTX-PRO-6000"}
    assert "prior share outside [0.2, 5]" in mix.columns       # the column is explained under it (issue 44)
    assert any(c.value.startswith("**prior share outside [0.2, 5]**: the cost model's prior") for c in at.caption)
    assert "Cost vs time per update" in _plotly_titles(at)
    binds = [m.value for m in at.markdown if m.value.startswith("**What binds:**")]   # why this mix: what binds
    assert len(binds) == 1 and ("binds" in binds[0] or "GPUs allowed" in binds[0]), binds
    assert "--" not in binds[0], binds                  # the page's field names, not CLI flags (issue 44)
    fig = json.loads(at.get("plotly_chart")[0].proto.spec)
    names = [t.get("name") for t in fig["data"]]
    assert "chosen mix (planner)" in names and "chosen mix (twin)" in names
    assert {"seed-mixed", "seed-homogeneous", "seed-mixed (twin)", "seed-homogeneous (twin)"} <= set(names)
    # the plan was on the page before the seed fleets' twin dry runs ended; then their circles joined the chart
    timing = at.session_state["plan_timing"]
    assert 0 < timing["plan_shown_s"] < timing["complete_s"], timing
    assert not at.session_state["plan_result"].pending_twin
    plan_toml = at.session_state["planned_plan"].toml
    from mixfleet.policies.plan import plan_from_dict

    plan = plan_from_dict(__import__("tomllib").loads(plan_toml))  # the download is a valid plan
    assert [g.name for g in plan.groups] == list(mix["group"])
    assert [b.label for b in at.get("download_button")] == ["Download the plan TOML"]
    # the same inputs again, in this session and in a new one (another tab): the cached plan, no error (issue 26:
    # the progress bar inside st.cache_data made the repeat fail with CacheReplayClosureError)
    for again in (at, _app()):
        again.button(key="pl_go").click()
        again.run()
        assert not again.exception, [e.value for e in again.exception]
        assert not again.error, [e.value for e in again.error]
        assert again.table[0].value.equals(mix)
        again_names = [t.get("name") for t in json.loads(again.get("plotly_chart")[0].proto.spec)["data"]]
        assert again_names == names                      # the cached view is the finished one
    at.switch_page("app_dryrun.py")
    at.run()  # the Dry-run page offers the planned mix as plan A, a shipped fleet as plan B
    assert not at.exception, [e.value for e in at.exception]
    assert at.radio(key="a_src").value == "Plan page" and at.radio(key="b_src").value == "Shipped plan"
    assert any("the Plan page's chosen mix: **planned**" in c.value for c in at.caption)


def test_plan_page_refuses_an_empty_pool(env: Path) -> None:
    at = _app()
    pool = at.data_editor[0]
    at.session_state[pool.key] = {"edited_rows": {i: {"use": False} for i in range(len(pool.value))},
                                  "added_rows": [], "deleted_rows": []}
    at.run()
    at.button(key="pl_go").click()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "at least one accelerator" in errors[0]


def test_runs_page_defaults_with_an_empty_folder_offers_a_demo_run(env: Path) -> None:
    at = _app("app_runs.py")
    assert [t.value for t in at.title] == ["Runs"]
    assert "No run log under" in _texts(at)
    demo = [b for b in at.button if "Dry-run the seed" in b.label]
    assert demo
    demo[0].click()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    titles = _plotly_titles(at)
    assert "Reward" in titles and "KL (k3) by group" in titles
    assert (env / "twin").is_dir()  # the demo dry run landed in the runs folder


def test_runs_page_charts_a_twin_run_log(env: Path, twin_run: tuple[Path, dict], monkeypatch) -> None:
    runs, _ = twin_run
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    at = _app("app_runs.py")
    pick = at.selectbox(key="runs_pick")
    pick.select_index([i for i, o in enumerate(pick.options) if o.startswith("twin-tiny")][0])
    at.run()
    assert not at.error, [e.value for e in at.error]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["updates"] == "3"
    assert metrics["cost/update"].startswith("$")
    titles = _plotly_titles(at)
    for t in ("Reward", "KL (k3) by group", "Share of tokens with ratio outside [0.2, 5]",
              "Staleness of trained tokens", "Tokens per second (per update window)"):
        assert t in titles
    text = _texts(at)
    assert "grad norm: not recorded" in text and "entropy: not recorded" in text  # the twin does not train
    assert "The twin does not train: its rewards are draws" in text   # issue 44: its Reward chart is no learning curve
    assert not [t for t in titles if t.startswith("Routing disagreement")]        # no routing prior: NaN, no chart
    assert not [t for t in at.toggle if t.value]  # a finished run: no auto-refresh


def test_runs_page_overlays_the_twin_on_a_runner_log(env: Path, twin_run: tuple[Path, dict], monkeypatch) -> None:
    runs, plan = twin_run
    real = runs / "real-run"
    if not real.exists():
        _runner_log(real, plan, status_running=True)
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    at = _app("app_runs.py")
    pick = at.selectbox(key="runs_pick")
    real_i = [i for i, o in enumerate(pick.options) if o.startswith("real-run")]
    assert real_i
    pick.select_index(real_i[0])
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Predicted vs measured" in [s.value for s in at.subheader]
    # issue 44 (stale widgets): the table says at how many updates it was computed (the run goes on under it)
    n = int(RunLog.open(real).updates["version"].nunique())
    assert any(c.value.startswith(f"Computed at {n} measured updates against the twin's ") for c in at.caption), \
        [c.value for c in at.caption]
    titles = _plotly_titles(at)
    assert "Grad norm" in titles and "Entropy" in titles
    assert len([t for t in titles if t.startswith("Routing disagreement by group")]) == 2   # MoE columns recorded
    assert [t for t in at.toggle if t.value]  # a running run refreshes itself
    table = at.dataframe[0].value
    row = table[table["metric"] == "mean staleness (versions)"].iloc[0]
    assert row["measured"] == pytest.approx((0.5 * 1001 + 1.0 * 1002 + 1.5 * 1003) / (1001 + 1002 + 1003))
    assert math.isfinite(row["predicted"])


def test_dry_run_page_simulates_two_plans_side_by_side(env: Path) -> None:
    at = _app("app_dryrun.py")
    assert [t.value for t in at.title] == ["Dry-run"]
    assert "Press **Simulate**" in _texts(at)
    at.button(key="dr_go").click()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    titles = _plotly_titles(at)
    assert titles.count("Timeline") == 2 and titles.count("Cost per update by group") == 2
    assert "Each group's part of the samples and of the extreme-ratio tokens" in titles
    assert "Side by side" not in titles      # once, as the section heading (issue 44: it was there twice)
    assert "Side by side" in [s.value for s in at.subheader]
    labels = [n.label for n in at.number_input]    # issue 44: two "updates" fields with different defaults
    assert "simulated updates" in labels and "Updates to run" in labels and "Updates" not in labels
    assert len(list((env / "twin").iterdir())) == 2  # both dry runs are run logs in the runs folder


@pytest.mark.parametrize(("name", "data", "expected"), [
    ("notes.txt", b"this is = not [toml", "not TOML"),
    ("binary.toml", b"\xff\xfe\x00\x01", "UTF-8"),
    ("fields.toml", b'name = "x"\n[[groups]]\nname = "g"\naccelerator = "H100"\nprecision = "fp8"\ncolour = 1\n',
     "colour"),
    ("nogroups.toml", b'name = "x"\n', "groups"),
])
def test_bad_upload_shows_the_validation_error(env: Path, name: str, data: bytes, expected: str) -> None:
    at = _app("app_dryrun.py")
    at.radio(key="a_src").set_value("Upload a plan TOML")
    at.run()
    at.file_uploader(key="a_upload").set_value((name, data, "application/octet-stream"))
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and expected in errors[0] and "Traceback" not in errors[0]


def test_ui_command_serves_headless_on_loopback_without_telemetry() -> None:
    from mixfleet.ui.commands.webapp import DEFAULT_HOST, app_path, free_port, streamlit_argv

    port = free_port()
    argv = streamlit_argv(port)
    assert DEFAULT_HOST == "127.0.0.1" and 0 < port < 65536
    assert argv[1:4] == ["-m", "streamlit", "run"] and Path(argv[4]) == app_path() and app_path().is_file()
    flags = dict(zip(argv[5::2], argv[6::2], strict=True))
    assert flags["--server.address"] == "127.0.0.1" and flags["--server.port"] == str(port)
    assert flags["--server.headless"] == "true" and flags["--browser.gatherUsageStats"] == "false"


@pytest.mark.slow
def test_sigterm_to_mixfleet_ui_stops_the_streamlit_child(tmp_path: Path) -> None:
    from mixfleet.ui.commands.webapp import free_port

    exe = Path(sys.executable).with_name("mixfleet")
    ui = subprocess.Popen([str(exe), "ui", "--port", str(free_port()), "--runs-dir", str(tmp_path)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    child = None
    try:
        for _ in range(900):                                 # a loaded machine: up to 90 s
            kids = [k for k in psutil.Process(ui.pid).children() if "streamlit" in " ".join(k.cmdline())]
            if kids:                                          # (a child caught before its exec looks like us)
                child = kids[0]
                break
            time.sleep(0.1)
        assert child is not None and "streamlit" in " ".join(child.cmdline())
        time.sleep(3.0)                                       # let it start serving
        ui.send_signal(signal.SIGTERM)
        ui.wait(timeout=90)
        _, alive = psutil.wait_procs([child], timeout=60)
        assert alive == [], "the Streamlit child outlived `mixfleet ui`"
    finally:
        if ui.poll() is None:
            ui.kill()
        if child is not None and child.is_running():            # only what this test started
            child.kill()


def test_runs_page_checks_the_twin_against_a_runner_log(env: Path) -> None:
    """A real run without a twin prediction: one click runs twin.calibrated.fidelity on it (priors), the
    fidelity table appears, and the kept twin log becomes the run's overlay."""
    from mixfleet.policies.plan import load_plan

    plan = load_plan("tiny-cpu").to_dict()
    _runner_log(env / "tiny-real", plan, updates=2)
    at = _app("app_runs.py")
    assert "No twin prediction for this plan" in _texts(at)
    assert "Twin fidelity" in [s.value for s in at.subheader]
    at.button(key="runs_fidelity").click()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    subheaders = [s.value for s in at.subheader]
    assert "Predicted vs measured" in subheaders and "Twin fidelity" in subheaders
    fid = at.dataframe[-1].value  # after the predicted-vs-measured overlay table
    row = fid[fid["metric"] == "time_per_update_mean_s"].iloc[0]
    assert row["measured"] == pytest.approx(10.0) and row["unit"] == "s" and row["error"].endswith("%")
    assert {"share_of_samples[cpu-bf16]", "kl_k3[cpu-fp8]"} <= set(fid["metric"])
    twin_logs = [p.name for p in (env / "twin").iterdir()]
    assert twin_logs == ["fidelity-tiny-real-priors"]


def test_plan_page_edited_workload_numbers_are_validated_and_used(env: Path) -> None:
    at = _app()
    at.number_input(key="pl_p_tiny-cpu").set_value(32)
    at.run()
    at.button(key="pl_go").click()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    plan_toml = at.session_state["planned_plan"].toml
    spec = next((env / "ui-specs").glob("workload-tiny-cpu-*.toml"))
    assert f'workload = "{spec}"' in plan_toml and "prompts_per_update = 32\n" in spec.read_text()
    at.text_area(key="pl_wt_tiny-cpu").set_value('name = "w"\nprompts_per_update = 0\n')
    at.run()
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "invalid model / workload numbers" in errors[0] and "Traceback" not in errors[0]


def test_the_dry_run_page_does_not_show_an_outside_tomls_values(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe on the page: an uploaded plan with `model = "/abs/secret.toml"`; the page names the field and what
    is allowed, and no value of the secret file appears, before or after Simulate."""
    pytest.importorskip("streamlit.testing.v1")
    from streamlit.testing.v1 import AppTest

    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    monkeypatch.setenv("MIXFLEET_UI_UPDATES", "1")
    monkeypatch.setenv("MIXFLEET_UI_WORKLOAD", "tiny-cpu")
    secret = tmp_path / "secret.toml"
    secret.write_text(f'name = "{SECRET}"\napi_key = "{SECRET}"\n')
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page("app_dryrun.py")
    at.run()
    at.radio(key="a_src").set_value("Upload a plan TOML")
    at.toggle(key="dr_two").set_value(False)
    at.run()
    at.file_uploader(key="a_upload").set_value(("plan.toml", plan_text(model=str(secret)).encode(),
                                                "application/octet-stream"))
    at.run()
    for b in at.button:
        if b.key == "dr_go" and not b.disabled:
            b.click().run()
            break
    assert not at.exception, [e.value for e in at.exception]
    shown = [str(e.value) for kind in ("markdown", "caption", "info", "warning", "error", "code", "text")
             for e in at.get(kind)]
    assert not [s for s in shown if SECRET in s], [s for s in shown if SECRET in s]
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "field 'model'" in errors[0] and "shipped" in errors[0], errors
