"""A plan's fields checked once, when it loads: formats against the registry (data/precisions.toml),
accelerators against the catalog, types and required fields (issue 12 items 1-3, issue 13 item 5); a binary plan
file is a one-line error and a plan's `base` is a shipped name or a file beside it (issue 13), and so are its
model and workload specs (issue 24, the second probe)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.policies.plan import load_plan, plan_from_dict
from mixfleet.ui.cli import app
from trust_helpers import SECRET, plan_text
from typer.testing import CliRunner

runner = CliRunner()


def _raw(**group: object) -> dict:
    g = {"name": "g", "accelerator": "H100", "precision": "fp8", **group}
    return {"name": "p", "model": "tiny", "workload": "tiny-cpu", "groups": [g]}


# ---- checked at load: formats ---------------------------------------------------------------------------
@pytest.mark.parametrize(("group", "field", "allowed"), [
    ({"precision": "fp16"}, "precision", "'nvfp4'"),
    ({"kv_dtype": "fp4"}, "kv_dtype", "'fp8_e4m3'"),
    ({"kernel": "fp16"}, "kernel", "'bf16'"),
])
def test_formats_are_checked_at_load_naming_group_field_value_and_allowed(group: dict, field: str,
                                                                          allowed: str) -> None:
    with pytest.raises(SpecError) as e:
        plan_from_dict(_raw(**group))
    msg = str(e.value)
    assert "group 'g'" in msg and f"'{field}'" in msg and repr(next(iter(group.values()))) in msg and allowed in msg


def test_kernel_fp16_is_refused_at_load_not_by_a_crash_looping_replica() -> None:
    # on main the plan loaded and the fleet handed "fp16" to each replica, which then failed to start
    with pytest.raises(SpecError, match="kernel"):
        plan_from_dict(_raw(kernel="fp16"))
    assert plan_from_dict(_raw(kernel="fp32")).groups[0].kernel == "fp32"


def test_noise_is_its_own_field_and_the_old_kernel_string_says_so() -> None:
    g = plan_from_dict(_raw(accelerator="CPU-2core", emulated=True, kernel="bf16", weight_noise=0.3)).groups[0]
    assert (g.kernel, g.weight_noise) == ("bf16", 0.3)
    with pytest.raises(SpecError, match="weight_noise = 0.3") as e:
        plan_from_dict(_raw(kernel="bf16+noise0.3"))
    assert "kernel = 'bf16'" in str(e.value)
    for bad in (-0.1, 10.0, True, "0.3"):
        with pytest.raises(SpecError, match="weight_noise"):
            plan_from_dict(_raw(weight_noise=bad))
    assert "weight_noise" not in load_plan("tiny-cpu").to_dict()["groups"][0]   # 0 stays out of written plans


# ---- checked at load: names, types, required fields ----------------------------------------------------
def test_accelerators_are_taken_case_insensitively_or_refused_with_the_known_names() -> None:
    p = plan_from_dict({**_raw(accelerator="h100"), "prices": {"b200": 5.0}, "trainer": {"accelerator": "cpu-2core"}})
    assert (p.groups[0].accelerator, p.prices, p.trainer.accelerator) == ("H100", {"B200": 5.0}, "CPU-2core")
    with pytest.raises(SpecError, match="'B200'") as e:
        plan_from_dict(_raw(accelerator="H900"))
    assert "accelerator" in str(e.value) and "'H900'" in str(e.value)


def test_a_precision_the_accelerator_only_emulates_needs_emulated_at_load() -> None:
    with pytest.raises(SpecError, match="emulated") as e:          # as the twin's cost model refuses it
        plan_from_dict(_raw(accelerator="A100-80GB", precision="fp8"))
    assert "native precision: bf16" in str(e.value)
    assert plan_from_dict(_raw(accelerator="A100-80GB", precision="fp8", emulated=True)).groups[0].emulated


@pytest.mark.parametrize(("group", "field"), [
    ({"emulated": "yes"}, "emulated"), ({"emulated": 1}, "emulated"),
    ({"replicas": True}, "replicas"), ({"replicas": "2"}, "replicas"), ({"replicas": 2.0}, "replicas"),
    ({"tp": True}, "tp"), ({"tp": 3}, "tp"), ({"replicas": 2, "min_replicas": True}, "min_replicas"),
])
def test_booleans_and_counts_refuse_strings_floats_and_true(group: dict, field: str) -> None:
    with pytest.raises(SpecError, match=f"'{field}'"):
        plan_from_dict(_raw(**group))


@pytest.mark.parametrize(("patch", "field"), [
    ({"trainer": {"gpus": True}}, "gpus"), ({"trainer": {"top_p_replay": "yes"}}, "top_p_replay"),
    ({"seed": True}, "seed"), ({"embedded": {"eval_every": True}}, "eval_every"),
    ({"embedded": {"temperature": True}}, "temperature"), ({"price_table": "aws"}, "price_table"),
    ({"trainer": {"precision": "fp16"}}, "precision"),
])
def test_other_tables_refuse_wrong_types_too(patch: dict, field: str) -> None:
    with pytest.raises(SpecError, match=f"'{field}'"):
        plan_from_dict({**_raw(), **patch})


def test_a_missing_model_or_workload_is_refused_unless_a_base_gives_it(tmp_path) -> None:
    for key in ("model", "workload"):
        raw = _raw()
        del raw[key]
        with pytest.raises(SpecError, match=f"'{key}' = None") as e:   # on main: the 35B seed model, silently
            plan_from_dict(raw)
        assert "base" in str(e.value)
    (tmp_path / "v.toml").write_text('base = "tiny-cpu"\nname = "v"\n')
    v = load_plan(tmp_path / "v.toml")
    assert (v.model, v.workload) == ("tiny", "tiny-cpu")


def test_calibration_reads_a_plan_with_the_same_schema() -> None:
    from mixfleet.costmodel.plan.planspec import plan_data_from_dict

    raw = load_plan("tiny-cpu").to_dict()
    data = plan_data_from_dict(raw)
    assert [g.name for g in data.groups] == ["cpu-bf16", "cpu-fp8", "cpu-nvfp4"] and data.trainer.gpus == 1
    with pytest.raises(SpecError, match="kernel"):
        plan_data_from_dict({**raw, "groups": [{**raw["groups"][0], "kernel": "fp16"}]})


def test_shipped_plans_live_in_one_place_and_benchmarks_write_under_results() -> None:
    from pathlib import Path

    from mixfleet.costmodel.paths import data_path
    from mixfleet.policies.plan import known_plans

    assert not data_path("fleets").exists()                   # data/fleets/seed-*.toml duplicated data/plans
    assert {"seed-mixed", "seed-homogeneous", "tiny-cpu"} <= set(known_plans())
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    assert sorted(p.name for p in bench.iterdir() if p.is_file() and p.suffix != ".py") == []


def test_a_binary_plan_file_is_a_one_line_error(tmp_path: Path) -> None:
    from mixfleet.policies.plan import load_plan

    plan = tmp_path / "plan.toml"
    plan.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(SpecError, match="binary data"):
        load_plan(plan)
    res = runner.invoke(app, ["simulate", str(plan), "-n", "1"])
    assert res.exit_code == 2 and "binary data" in res.output and not isinstance(res.exception, UnicodeDecodeError)


def test_an_uploaded_plan_base_is_a_shipped_name_or_a_file_beside_it(tmp_path: Path) -> None:
    from mixfleet.policies.plan import load_plan
    from mixfleet.ui.app_common import plan_from_upload

    secret = tmp_path / "elsewhere" / "secrets.toml"
    secret.parent.mkdir()
    secret.write_text('api_key = "SECRET-123"\n')
    for base in (str(secret), "../elsewhere/secrets.toml", "/etc/passwd"):
        with pytest.raises(SpecError, match="base") as err:
            plan_from_upload(f'base = "{base}"\nname = "x"\n'.encode())
        assert "SECRET-123" not in str(err.value) and "shipped" in str(err.value)
    assert plan_from_upload(b'base = "tiny-cpu"\nname = "mine"\n').name == "mine"
    own = tmp_path / "plans"
    own.mkdir()
    (own / "parent.toml").write_text('base = "tiny-cpu"\nname = "parent"\nseed = 5\n')
    (own / "child.toml").write_text('base = "parent.toml"\nname = "child"\n')
    assert load_plan(own / "child.toml").seed == 5
    os.symlink(secret, own / "link.toml")                      # a link out of the folder counts as outside
    (own / "sneaky.toml").write_text('base = "link.toml"\nname = "s"\n')
    with pytest.raises(SpecError, match="base"):
        load_plan(own / "sneaky.toml")


@pytest.mark.parametrize("field", ["model", "workload"])
def test_an_uploaded_plan_cannot_read_a_toml_file_elsewhere(tmp_path: Path, field: str) -> None:
    from mixfleet.ui.app_common import plan_from_upload

    secret = tmp_path / "secret.toml"
    secret.write_text(f'api_key = "{SECRET}"\n')
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "link.toml").symlink_to(secret)
    for ref in (str(secret), "../secret.toml", "link.toml"):
        with pytest.raises(SpecError) as e:
            plan_from_upload(plan_text(**{field: ref}).encode())
        msg = str(e.value)
        assert f"field '{field}'" in msg and ref in msg and "shipped" in msg and SECRET not in msg, msg
    # the same rule for a plan file on disk: a link out of its folder is refused, a spec beside it is fine
    (tmp_path / "up" / "plan.toml").write_text(plan_text(**{field: "link.toml"}))
    with pytest.raises(SpecError, match=f"field '{field}'"):
        load_plan(tmp_path / "up" / "plan.toml")
    shipped = load_plan("tiny-cpu")
    spec_name = "tiny" if field == "model" else "tiny-cpu"
    folder = "models" if field == "model" else "workloads"
    from mixfleet.costmodel.paths import data_path

    (tmp_path / "up" / "mine.toml").write_text(data_path(folder, f"{spec_name}.toml").read_text())
    (tmp_path / "up" / "plan.toml").write_text(plan_text(**{field: "mine.toml"}))
    plan = load_plan(tmp_path / "up" / "plan.toml")
    assert getattr(plan, field) == str((tmp_path / "up" / "mine.toml").resolve())   # beside it, wherever the CWD
    assert getattr(shipped, field) == spec_name                                     # shipped names stay names
