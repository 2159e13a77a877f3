"""``stoa plot``: the PNG read back (size, every panel drawn, a second run in a second color), curves from
forged metrics rows, the command's exits, an s3 bucket (moto) and a real tiny run plotted live and finished."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from stoa.bucket import open_bucket
from stoa.layout import metrics_prefix, rollout_key, rollout_label
from stoa.observe import plotdata
from stoa.observe.plot import PLOT_HINT, render, time_unit
from stoa.observe.plotdata import PANELS, WORKER_WINDOW, load_run, read_sourced_rows, run_curves
from stoa.telemetry.metrics import BucketMetrics, read_bucket_metrics
from tests.bucket.conftest import TEST_BUCKET, moto_endpoint, moto_env  # noqa: F401 - the fixture

mpimg = pytest.importorskip("matplotlib.image", reason="stoa plot needs matplotlib (the plot extra)")

T0 = 1_700_000_000.0
RGB = {"C0": (0x1F, 0x77, 0xB4), "C1": (0xFF, 0x7F, 0x0E)}


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def write_run(bucket, run: str, *, versions=range(2, 14), workers=("w0", "w1"), slope: float = 0.03,
              only: tuple[str, ...] = ()) -> None:
    """Trainer metrics chunks through the real writer: one step row per version (records of ``workers``
    sampled at version - 1) and an eval row every third version; each worker's chunk with one sampled batch per
    version (unless ``only``, which keeps just those trainer metrics)."""
    sink = BucketMetrics(bucket, run, "trainer", flush_rows=5, clock=Clock(T0))
    for v in versions:
        keys = [rollout_label(rollout_key(run, v - 1, w, v)) for w in workers]
        row = {"time": T0 + 10 * v, "step": v - 1, "version": v, "train/loss": 0.1 * np.sin(v), "train/kl": 0.01 * v,
               "train/clip_frac_low": 0.02 * (v % 3), "train/clip_frac_high": 0.03 * (v % 2),
               "train/gate_frac": 0.01 * (v % 4), "rollout/reward_mean": 0.2 + slope * v, "rollout/lag_mean": v % 3,
               "rollout/lag_max": v % 3 + 1, "rollout/records_per_s": 2.0 + v % 5, "rollout/keys": keys}
        sink.add({k: x for k, x in row.items() if not only or k in only or k in ("time", "version")})
        if v % 3 == 0 and not only:
            sink.add({"time": T0 + 10 * v + 5, "version": v, "eval/accuracy": 0.05 * v})
    sink.flush()
    for w in () if only else workers:
        sink = BucketMetrics(bucket, run, f"worker-{w}", flush_rows=100, clock=Clock(T0))
        for v in versions:
            sink.add({"time": T0 + 10 * v + 1, "worker/version": v - 1, "worker/tokens_per_s": 50.0})
        sink.flush()


def pixels(png: Path, box, color: str) -> tuple[int, float]:
    """(pixels of ``color`` within 0.1 per channel, standard deviation) inside a panel box, spines excluded."""
    img = mpimg.imread(png)[box.top + 3:box.bottom - 3, box.left + 3:box.right - 3, :3]
    near = np.all(np.abs(img - np.array(RGB[color]) / 255.0) < 0.1, axis=-1)
    return int(near.sum()), float(img.std())


def boxes(result) -> dict:
    return {b.name: b for b in result.panels}


def test_every_panel_draws_its_curves_in_the_configured_size(tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    write_run(bucket, "r")
    result = render([load_run(bucket, "r")], tmp_path / "out" / "r.png", width=900, height=700)
    img = mpimg.imread(result.path)
    assert img.shape[:2] == (700, 900)
    assert [b.name for b in result.panels] == [p.name for p in PANELS]
    for box in result.panels:
        assert box.lines >= 1, box
        count, std = pixels(result.path, box, "C0")
        assert count > 0 and std > 0, box
    assert boxes(result)["clip"].lines == 3 and boxes(result)["lag"].lines == 2
    assert boxes(result)["eval"].lines == 1  # accuracy only: no cover-EM in a GSM8K-like run


def test_compare_overlays_each_run_in_its_own_color(tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    write_run(bucket, "a")
    write_run(bucket, "b", slope=-0.01)
    alone = render([load_run(bucket, "a")], tmp_path / "a.png", width=900, height=700)
    both = render([load_run(bucket, "a"), load_run(bucket, "b")], tmp_path / "ab.png", width=900, height=700)
    for name in ("reward", "eval", "kl", "workers"):
        assert pixels(alone.path, boxes(alone)[name], "C1")[0] == 0
        assert pixels(both.path, boxes(both)[name], "C1")[0] > 0, name
    assert pixels(both.path, boxes(both)["reward"], "C0")[0] > 0  # elsewhere b's curves hide a's identical ones
    assert boxes(both)["reward"].lines == 2


def test_a_panel_without_data_says_so_instead_of_failing(tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    write_run(bucket, "r", only=("rollout/reward_mean",))
    result = render([load_run(bucket, "r")], tmp_path / "r.png", width=900, height=700)
    drawn = {b.name for b in result.panels if b.lines}
    assert drawn == {"reward"}
    for box in result.panels:
        count, std = pixels(result.path, box, "C0")
        assert (count > 0) == (box.name == "reward")
        assert std > 0  # the curve, or the words "no data"
    empty = render([load_run(bucket, "nothing")], tmp_path / "none.png", width=900, height=700)
    assert all(b.lines == 0 for b in empty.panels)


def test_cover_em_replaces_accuracy_for_search_tasks(tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    write_run(bucket, "r")
    BucketMetrics(bucket, "r", "trainer", flush_rows=1, clock=Clock(T0 + 999)).add(
        {"time": T0 + 999, "version": 13, "eval/accuracy": 0.5, "eval/cover_em": 0.25})
    curves = load_run(bucket, "r")
    assert [p[2] for p in curves.curves["eval/cover_em"].rows] == [0.25]
    result = render([curves], tmp_path / "r.png", width=900, height=700)
    assert boxes(result)["eval"].lines == 1


def test_worker_count_is_of_sampled_records_from_worker_batches_and_listed_keys(tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    write_run(bucket, "r", versions=range(2, 14))  # w0 and w1 sample a batch at every version 1..12
    for source, row in (("worker-w2", {"worker/version": 5, "worker/tokens_per_s": 9.0}),  # a batch at v5
                        ("worker-w3", {"worker/version": 6, "worker/paused": 1}),  # paused: sampled nothing
                        ("eval-1", {"worker/version": 7, "worker/tokens_per_s": 9.0})):  # an evaluator is no worker
        BucketMetrics(bucket, "r", source, flush_rows=1, clock=Clock(T0)).add({"time": T0 + 50, **row})
    bucket.put_create(rollout_key("r", 11, "w4", 0), b"record")  # sampled, its worker's chunk not landed yet
    counts = {v: n for v, _, n in load_run(bucket, "r").curves["workers"].rows}
    assert WORKER_WINDOW == 4
    with_w2, with_w4 = {5, 6, 7, 8}, {11, 12}  # w2 sampled version 5: counted at versions 5..8
    assert counts == {v: 2.0 + (v in with_w2) + (v in with_w4) for v in range(1, 13)}
    trained_only = plotdata.run_curves("r", [(s, r) for s, r in read_sourced_rows(bucket, "r") if s == "trainer"])
    assert "workers" not in trained_only.curves


def test_forged_rows_and_chunks_are_skipped(tmp_path, monkeypatch):
    clean, forged = open_bucket(str(tmp_path / "clean")), open_bucket(str(tmp_path / "forged"))
    write_run(clean, "r")
    write_run(forged, "r")
    bad_rows = [b"not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000, b'"a string"',
                b'{"version": "3", "rollout/reward_mean": 1}', b'{"version": true, "rollout/reward_mean": 1}',
                b'{"version": -1, "rollout/reward_mean": 1}', b'{"version": 3, "rollout/reward_mean": NaN}',
                b'{"version": 3, "rollout/reward_mean": 1e400}', b'{"version": 3, "train/kl": 1' + b"0" * 400 + b"}",
                b'{"version": 3, "rollout/reward_mean": "0.5", "train/loss": [1], "train/kl": {"a": 1}}',
                b'{"version": 3, "rollout/reward_mean": true, "train/loss": false, "time": "now"}',
                b'{"version": 3, "rollout/keys": "v00000001/w9-00000001.rec"}',
                b'{"version": 3, "rollout/keys": [1, null, "../../x", "v00000001/bad id-00000001.rec", ["x"]]}',
                b'{"version": 99999999999, "train/loss": 1}', b'{"version": 3, "train/loss": ' + b"7" * 5001 + b"}"]
    forged.put(metrics_prefix("r") + "trainer-1800000000-00000000.jsonl", b"\n".join(bad_rows))
    forged.put(metrics_prefix("r") + "evil-1800000000-00000000.jsonl",  # not the trainer: no train/rollout rows
               b'{"version": 4, "time": 1700000040, "train/loss": 9, "rollout/reward_mean": 9}')
    forged.put(metrics_prefix("r") + "trainer-junk.jsonl", b'{"version": 4, "train/loss": 9}')  # not a chunk name
    big = b'{"version": 4, "train/loss": 9}\n' * 5000  # larger than the forged chunk above
    forged.put(metrics_prefix("r") + "trainer-1800000001-00000000.jsonl", big)
    monkeypatch.setattr(plotdata, "MAX_CHUNK_BYTES", len(big) - 1)  # an oversized chunk is never fetched
    got, want = load_run(forged, "r"), load_run(clean, "r")
    assert got.curves == want.curves and got.start == want.start
    render([got], tmp_path / "r.png", width=900, height=700)
    assert len(read_sourced_rows(forged, "r")) == len(read_sourced_rows(clean, "r")) + 9  # bounded dicts, then skipped


def test_time_axis_counts_minutes_from_the_first_row_and_hours_for_long_runs(tmp_path):
    from stoa.observe.plot import xy

    bucket = open_bucket(str(tmp_path / "b"))
    write_run(bucket, "r", versions=range(2, 6))
    curves = load_run(bucket, "r")
    xs, ys = xy(curves.curves["rollout/reward_mean"], "minutes", curves.start)
    assert xs == pytest.approx([0.0, 10 / 60, 20 / 60, 30 / 60]) and ys == pytest.approx([0.26, 0.29, 0.32, 0.35])
    assert time_unit([curves]) == "minutes"
    long = run_curves("r", [("trainer", {"time": T0, "version": 1, "train/loss": 0.0}),
                            ("trainer", {"time": T0 + 4 * 3600, "version": 2, "train/loss": 0.0}),
                            ("trainer", {"time": 5.0, "version": 3, "train/loss": 1.0})])  # an implausible time
    assert time_unit([long]) == "hours" and xy(long.curves["train/loss"], "hours", long.start)[0] == [0.0, 4.0]
    result = render([curves], tmp_path / "t.png", x="time", width=900, height=700)
    assert all(b.lines >= 1 for b in result.panels)


def test_the_command_writes_the_png_and_refuses_with_exit_2(tmp_path, capsys, monkeypatch):
    from stoa.cli import main

    write_run(open_bucket(str(tmp_path / "b")), "r")
    out = tmp_path / "r.png"
    assert main(["plot", "--bucket", str(tmp_path / "b"), "--run", "r", str(out), "--size", "800x600",
                 "--x", "time"]) == 0
    assert mpimg.imread(out).shape[:2] == (600, 800)
    write_run(open_bucket(str(tmp_path / "b")), "r2", slope=0.0)
    assert main(["plot", "--bucket", str(tmp_path / "b"), "--run", "r", "--compare", "r2", str(out)]) == 0
    assert pixels(out, boxes(render([load_run(open_bucket(str(tmp_path / "b")), "r")], tmp_path / "ref.png"))["reward"],
                  "C1")[0] > 0
    assert main(["plot", "--bucket", str(tmp_path / "b"), "--run", "r", "--compare", "r2,typo", str(out)]) == 12
    assert main(["plot", "--bucket", str(tmp_path / "b"), "--run", "r", "--size", "big", str(out)]) == 2
    capsys.readouterr()
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if matplotlib were not installed
    assert main(["plot", "--bucket", str(tmp_path / "b"), "--run", "r", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and PLOT_HINT in err[0]
    assert not (tmp_path / "x.png").exists()


def test_an_s3_bucket_plots_like_a_local_one(moto_endpoint, tmp_path, monkeypatch):  # noqa: F811 - the fixture
    from stoa.cli import main

    env = moto_env(moto_endpoint)
    url = f"s3://{TEST_BUCKET}/plot-{uuid.uuid4().hex[:8]}"
    bucket = open_bucket(url, env)
    write_run(bucket, "a")
    write_run(bucket, "b", slope=0.0)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "s3.png"
    assert main(["plot", "--bucket", url, "--run", "a", "--compare", "b", str(out), "--size", "900x700"]) == 0
    local = tmp_path / "local"
    write_run(open_bucket(str(local)), "a")
    assert load_run(bucket, "a").curves == load_run(open_bucket(str(local)), "a").curves
    result = render([load_run(bucket, "a"), load_run(bucket, "b")], tmp_path / "again.png", width=900, height=700)
    assert np.array_equal(mpimg.imread(out), mpimg.imread(result.path))
    assert pixels(out, boxes(result)["reward"], "C1")[0] > 0


@pytest.mark.slow
def test_a_real_tiny_run_plots_while_live_and_once_finished(tmp_path, stoa_cache):
    import os

    bucket_dir = tmp_path / "b"
    env = {**os.environ, "STOA_CACHE": str(stoa_cache), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    sets = ["lr=3e-2", "eval_n=8", "eval_every=5", "kl_beta=0.01", "max_new_tokens=8", "n_samples=4",
            "groups_per_step=4", "metrics_flush_rows=1"]
    cmd = [sys.executable, "-m", "stoa", "quickstart", "--model", "tiny", "--task", "toy", "--workers", "2",
           "--steps", "16", "--bucket", str(bucket_dir), "--run", "q", *[a for s in sets for a in ("--set", s)]]
    with open(tmp_path / "quickstart.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 120
            while sum("train/loss" in r for r in read_bucket_metrics(open_bucket(str(bucket_dir)), "q")) < 3:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "quickstart.log").read_text()
                time.sleep(0.3)
            live_run = load_run(open_bucket(str(bucket_dir)), "q")
            live = render([live_run], tmp_path / "live.png", width=900, height=700)
            live_rows = live_run.curves["rollout/reward_mean"].rows
            assert proc.wait(timeout=180) == 0, (tmp_path / "quickstart.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    final = load_run(open_bucket(str(bucket_dir)), "q")
    assert boxes(live)["reward"].lines == 1 and pixels(live.path, boxes(live)["reward"], "C0")[0] > 0
    assert len(final.curves["rollout/reward_mean"].rows) == 16
    assert len(live.panels) == len(PANELS) and len(live_rows) < 16
    done = render([final], tmp_path / "done.png", width=900, height=700)
    for box in done.panels:
        assert box.lines >= 1 and pixels(done.path, box, "C0")[0] > 0, box
    assert {1, 6, 11, 16} <= {v for v, _, _ in final.curves["eval/accuracy"].rows}
    assert max(n for _, _, n in final.curves["workers"].rows) <= 2


def test_every_panel_shares_one_x_range_with_whole_version_ticks(tmp_path, monkeypatch):
    from stoa.observe import plot

    bucket = open_bucket(str(tmp_path / "b"))
    write_run(bucket, "r", versions=range(2, 5))  # trainer rows at v2..4, an eval at v3, workers at v1..3
    seen = []

    def spy(ax, panel, runs, x, xlim=None):
        drawn = real(ax, panel, runs, x, xlim)
        seen.append((panel.name, ax.get_xlim(), list(ax.get_xticks())))
        return drawn

    real = plot.draw_panel
    monkeypatch.setattr(plot, "draw_panel", spy)
    render([load_run(bucket, "r")], tmp_path / "r.png", width=900, height=700)
    assert len(seen) == len(PANELS)
    for name, lim, ticks in seen:
        assert lim == pytest.approx((1 - 0.06, 4 + 0.06)), name  # v1..v4 (the workers' v1 included), padded 2 %
        assert ticks and all(t == int(t) for t in ticks), (name, ticks)  # matplotlib alone would tick 1.5, 2.5
    assert plot.x_range([load_run(bucket, "nothing")], "version") is None
