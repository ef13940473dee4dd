"""The read fit (`slacktier probe --read-fit`: store.measure measures, plan.readfit fits, serve.readfit writes the
tiers file) on a real staged table and real page sources, and the fit alone on reads made to a known model.

No wall-clock assertions: the tests check what is measured and written (shapes, counts, the model the file
carries, that plan reads it back), not how fast the reads were.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from slacktier import cli
from slacktier.errors import SlackTierError
from slacktier.plan import TIERS_FORMAT, DeviceReadModel, TierSpec, device_design, load_tiers, write_tiers
from slacktier.plan.readfit import MIN_READ_FIT_RUNS, describe_fit, fit_read_runs
from slacktier.store.measure import ReadRuns
from slacktier.serve.readfit import read_fit


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    from slacktier.tables.stage import stage_synthetic

    d = tmp_path_factory.mktemp("readfit")
    return stage_synthetic([d / "t.bin"], {1: 30_000, 14: 30_000}, 1, 0, overwrite=True, manifest_path=d / "t.json")


@pytest.mark.parametrize("tier", ["dram", "disk"])
def test_read_fit_on_a_staged_table_gives_the_tiers_device_model(staged, tier):
    fit = read_fit(tier, staged, (1, 14), runs=9, max_pages=(200, 200))
    assert fit.spec.name == tier and fit.spec.holds_table == (tier == "dram")
    assert fit.runs.layers == (1, 14) and fit.runs.pages.shape == fit.runs.read_ms.shape == (9, 2)
    assert ((fit.runs.pages >= 1) & (fit.runs.pages <= 200)).all()
    assert fit.fit.fit_runs == 6 and fit.fit.quality.runs == 12 and fit.fit.held_out.runs == 6
    # the model is the least-squares fit of the runs it measured, every term >= 0
    m = fit.spec.read
    assert min(m.intercept_ms, m.page_ms, m.ahead_page_ms, m.behind_page_ms) >= 0
    pred = device_design(fit.runs.pages[:6]) @ np.array([m.intercept_ms, m.page_ms, m.ahead_page_ms,
                                                          m.behind_page_ms])
    resid = fit.runs.read_ms[:6].reshape(-1) - pred
    assert fit.fit.quality.rmse_ms == pytest.approx(float(np.sqrt(np.mean(resid ** 2))), rel=1e-9)
    assert fit.spec.fit.runs == 6 and fit.spec.fit.held_out_runs == 3
    assert describe_fit(fit).startswith(f"{tier}: T_l = ")
    assert fit.runs.csv().splitlines()[0] == "run,pages_l1,pages_l14,read_ms_l1,read_ms_l14"
    with pytest.raises(SlackTierError, match=f"at least {MIN_READ_FIT_RUNS} runs"):
        read_fit("dram", staged, (1, 14), runs=5)


def test_the_fit_alone_recovers_the_model_the_reads_were_made_with():
    """The worked example of plan.readfit.fit_read_runs: exact reads of a known model give that model back."""
    rng = np.random.default_rng(3)
    pages = rng.integers(1, 500, size=(12, 2)).astype(np.float64)
    read_ms = np.stack([0.3 + 0.02 * pages[:, 0] + 0.01 * pages[:, 1],
                        0.3 + 0.02 * pages[:, 1] + 0.015 * pages[:, 0]], axis=1)
    f = fit_read_runs(ReadRuns("disk", (1, 14), pages, read_ms), measured="by hand")
    m = f.spec.read
    assert (m.intercept_ms, m.page_ms, m.ahead_page_ms, m.behind_page_ms) == pytest.approx((0.3, 0.02, 0.015, 0.01))
    assert not f.spec.holds_table and f.spec.fit.measured == "by hand"
    assert (f.spec.fit.runs, f.spec.fit.held_out_runs) == (8, 4) and f.fit.held_out.rmse_ms == pytest.approx(0, abs=1e-9)
    with pytest.raises(SlackTierError, match=f"at least {MIN_READ_FIT_RUNS} runs"):
        fit_read_runs(ReadRuns("disk", (1, 14), pages[:5], read_ms[:5]))


def test_probe_read_fit_writes_a_tiers_file_that_plan_reads(staged, tmp_path, capsys):
    out = tmp_path / "tiers.toml"
    # an earlier file's tier that is not refitted is kept
    write_tiers([TierSpec("disk", DeviceReadModel(0.3, 0.003, 0.003, 0.0004), holds_table=False)], out)
    assert cli.main(["probe", "--read-fit", staged.path, "--read-tier", "dram", "--read-runs", "9",
                     "--read-max-pages", "100", "--tiers-out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("dram: T_l = ") and "kept disk" in printed
    text = out.read_text()
    assert text.startswith("# SlackTier tiers file") and f'format = "{TIERS_FORMAT}"' in text
    disk, dram = load_tiers(out)
    assert disk.read == DeviceReadModel(0.3, 0.003, 0.003, 0.0004) and disk.fit is None
    assert dram.holds_table and dram.fit.runs == 6 and dram.fit.held_out_runs == 3
    assert "slacktier probe --read-fit" in dram.fit.measured
    runs_csv = (tmp_path / "tiers.toml.dram.runs.csv").read_text().splitlines()
    assert len(runs_csv) == 1 + 9
    # `slacktier plan` takes the file as it is
    curves = tmp_path / "curves.json"
    curves.write_text(json.dumps({"workload": "agent", "batch": 8, "layers": {
        "1": {"capacity_rows": [0, 1000], "pages_per_step": [100, 50]},
        "14": {"capacity_rows": [0, 1000], "pages_per_step": [100, 50]}}}))
    assert cli.main(["plan", "--table", f"1={staged.path}", "--table", f"14={staged.path}", "--window", "1=1000",
                     "--window", "14=2000", "--tiers", str(out), "--curves", str(curves), "--cache-rows", "1000",
                     "--target-ms", "0", "--out", str(tmp_path / "control.toml")]) == 0
    assert "predicted slowdown 0.000" in capsys.readouterr().out


def test_probe_read_fit_refuses_layers_the_manifest_lacks(staged, tmp_path, capsys):
    assert cli.main(["probe", "--read-fit", staged.path, "--read-tier", "dram", "--read-layers", "1,7",
                     "--read-runs", "9", "--tiers-out", str(tmp_path / "t.toml")]) == 2
    assert "--read-layers [1, 7]" in capsys.readouterr().err
    assert not (tmp_path / "t.toml").exists()


def test_probe_read_fit_fits_a_redis_read_model_from_a_loaded_table(staged, tmp_path, capsys):
    """`--read-tier redis --url`: the loaded table is read through the Redis tier as the engine opens it; without
    --url it is refused in one line before anything is measured."""
    import shutil

    from slacktier.config import RedisOptions
    from slacktier.store.redis.loader import load_manifest
    from slacktier.testing.store import RedisServer

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (apt-get install -y redis-server; scripts/test.sh does)")
    out = tmp_path / "tiers.toml"
    argv = ["probe", "--read-fit", staged.path, "--read-tier", "redis", "--read-runs", "9", "--read-max-pages", "60",
            "--tiers-out", str(out)]
    assert cli.main(argv) == 2 and "--read-tier redis without --url" in capsys.readouterr().err
    srv = RedisServer(tmp_path)
    try:
        load_manifest(RedisOptions(url=srv.url), staged, tag_buckets=8)
        assert cli.main([*argv, "--url", srv.url]) == 0
        assert capsys.readouterr().out.startswith("redis: T_l = ")
        (redis_tier,) = load_tiers(out)
        assert redis_tier.name == "redis" and not redis_tier.holds_table and redis_tier.fit.runs == 6
        assert f"--read-tier redis" in redis_tier.fit.measured
    finally:
        srv.stop()


def test_a_read_fit_below_the_trusted_r2_warns_and_its_scatter_is_drawn(staged, tmp_path, capsys):
    import dataclasses

    from slacktier.plan.fit import FitQuality
    from slacktier.plan.readfit import TRUSTED_HELD_OUT_R2, fit_warning, predicted_read_ms
    from slacktier.serve.readfit import plot_read_fit

    fit = read_fit("dram", staged, (1, 14), runs=9, max_pages=(200, 200))
    poor = dataclasses.replace(fit, fit=dataclasses.replace(fit.fit, held_out=FitQuality(0.55, 1.0, 6)))
    good = dataclasses.replace(fit, fit=dataclasses.replace(fit.fit, held_out=FitQuality(0.95, 1.0, 6)))
    assert fit_warning(poor).startswith(f"WARNING dram: held-out R^2 0.55 is below {TRUSTED_HELD_OUT_R2}")
    assert fit_warning(good) is None   # negative control
    pred = predicted_read_ms(fit)
    m = fit.spec.read
    p = fit.runs.pages[0]
    assert pred[0, 0] == pytest.approx(m.intercept_ms + m.page_ms * p[0] + m.behind_page_ms * p[1])
    assert pred[0, 1] == pytest.approx(m.intercept_ms + m.page_ms * p[1] + m.ahead_page_ms * p[0])
    assert plot_read_fit(fit, tmp_path / "fit.png").stat().st_size > 5000
    assert max(map(len, describe_fit(fit).splitlines())) <= 120


def test_probe_read_fit_writes_its_scatter_beside_the_tiers_file(staged, tmp_path, capsys):
    out = tmp_path / "tiers.toml"
    assert cli.main(["probe", "--read-fit", staged.path, "--read-tier", "dram", "--read-runs", "9",
                     "--read-max-pages", "100", "--tiers-out", str(out)]) == 0
    assert (tmp_path / "tiers.toml.dram.fit.png").stat().st_size > 5000
    assert f"wrote {tmp_path / 'tiers.toml.dram.fit.png'}" in capsys.readouterr().out
