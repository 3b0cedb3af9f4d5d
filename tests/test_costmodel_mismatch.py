"""Mismatch priors: the most specific rule wins; the seed's figures are reproduced; bad files are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.paths import data_path
from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.costmodel.specs.mismatch import load_mismatch_priors, mismatch_prior

TEXT = data_path("mismatch.toml").read_text()

# the seed's mixed fleet: sample shares it reports (H100-FP8 10%, B200+B300 NVFP4 47%) and, for the
# five other groups (43% together), an equal split
MIXED = [("H100", "fp8", 0.10), ("B200", "nvfp4", 0.235), ("B300", "nvfp4", 0.235)] + [
    (a, p, 0.43 / 5) for a, p in (("H200", "fp8"), ("H100", "bf16"), ("H200", "bf16"), ("A100-80GB", "bf16"),
                                  ("RTX-PRO-6000", "bf16"))]


def test_most_specific_rule_wins_and_objects_are_accepted() -> None:
    cat = load_catalog()
    h100 = mismatch_prior(cat.accelerator("H100"), cat.precision("fp8"), cat.kv_dtype("fp8_e4m3"))
    h200 = mismatch_prior("H200", "fp8", "fp8_e4m3")
    assert h100.accelerator == "H100" and h200.accelerator == "*"
    assert h100.extreme_share == pytest.approx(0.003) and not h100.estimate   # the seed's ~0.3%
    assert mismatch_prior("h100", "FP8").accelerator == "H100"                # default KV: fp8_e4m3
    assert mismatch_prior("CPU-2core", "fp32", "fp32").source
    for a in cat.accelerators:
        for p in cat.precisions:
            for kv in cat.kv_dtypes:
                if cat.support(a, p) != "unsupported" and not (p == "fp32") and kv != "fp32":
                    assert mismatch_prior(a, p, kv).kl_k3 > 0


def test_priors_reproduce_the_seed_shares() -> None:
    n = sum(s for *_, s in MIXED)
    kl_mixed = sum(s * mismatch_prior(a, p, "fp8_e4m3").kl_k3 for a, p, s in MIXED) / n
    kl_homog = mismatch_prior("B200", "bf16", "bf16").kl_k3
    assert kl_mixed / kl_homog == pytest.approx(4.7, rel=0.02)
    ext = {(a, p): s * mismatch_prior(a, p, "fp8_e4m3").extreme_share for a, p, s in MIXED}
    total = sum(ext.values())
    assert ext[("H100", "fp8")] / total == pytest.approx(0.29, abs=0.01)
    assert (ext[("B200", "nvfp4")] + ext[("B300", "nvfp4")]) / total == pytest.approx(0.16, abs=0.01)


def test_growth_with_staleness() -> None:
    p = mismatch_prior("H100", "fp8")
    assert p.kl_at(0) == p.kl_k3
    assert p.kl_at(4) == pytest.approx(p.kl_k3 * (1 + 4 * p.growth_per_staleness))
    assert p.extreme_share_at(1e9) == 1.0


@pytest.mark.parametrize("old,new,field", [
    ("extreme_share = 3.0e-3", "extreme_share = 3.0", "extreme_share"),
    ("kl_k3 = 1.36e-2", 'kl_k3 = "big"', "kl_k3"),
    ("band = [0.2, 5.0]", "band = [2, 5.0]", "band"),
    ("estimate = false\nsource = \"seed [s1]", "estimat = false\nsource = \"seed [s1]", "estimat"),
])
def test_bad_mismatch_file(tmp_path: Path, old: str, new: str, field: str) -> None:
    assert old in TEXT
    f = tmp_path / "m.toml"
    f.write_text(TEXT.replace(old, new, 1))
    with pytest.raises(SpecError) as e:
        load_mismatch_priors(f)
    assert e.value.field == field


def test_no_matching_rule_lists_the_rules(tmp_path: Path) -> None:
    f = tmp_path / "m.toml"
    f.write_text('schema = 1\ngrowth_per_staleness = 0.1\n[[priors]]\naccelerator = "H100"\nprecision = "fp8"\n'
                 'kv_dtype = "bf16"\nkl_k3 = 0.01\nextreme_share = 0.001\nsource = "test"\n')
    with pytest.raises(SpecError) as e:
        mismatch_prior("B200", "bf16", "bf16", path=f)
    assert "H100/fp8/bf16" in str(e.value)
