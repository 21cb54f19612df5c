"""tools/compose_convergence.py: real 2-rank runs of the demo, seed-paired gaps, the JSON it writes."""
import json
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "compose_convergence.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import compose_convergence as cc  # noqa: E402

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--context", "32", "--batch-size", "8",
        "--corpus-mb", "0.2", "--warmup", "4", "--lr", "3e-3"]


def run_tool(args, timeout=100):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", MPLBACKEND="Agg")
    proc = subprocess.Popen([sys.executable, TOOL, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the tool kills the run in flight with its ranks
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"compose_convergence did not finish within {timeout}s:\n{out}")
    return proc.returncode, out


@pytest.mark.timeout(150)
def test_two_rank_pair_writes_the_seed_paired_gap(tmp_path):
    """The int8+EF streaming combination against blocking K=16: both run, the JSON holds the cell."""
    out_dir = tmp_path / "compose"
    rc, out = run_tool(["--only", "k16,k16-p4t2-int8ef", "--seeds", "0", "--steps", "16",
                        "--eval-every", "8", "--eval-batches", "2", "--timeout", "60",
                        "--out", str(out_dir), "--", *TINY])
    assert rc == 0, out
    assert "[1/2] k16 seed 0" in out and "ETA" in out and "[2/2] k16-p4t2-int8ef seed 0" in out
    doc = json.loads((out_dir / "compose.json").read_text())
    assert doc["steps"] == 16 and doc["nproc"] == 2 and doc["seeds"] == [0]
    assert doc["ranks_disagree"] == []
    base, new = doc["configs"]["k16"], doc["configs"]["k16-p4t2-int8ef"]
    for c in (base, new):
        run = c["runs"]["0"]
        assert run["ranks_agree"] and run["syncs"] > 0
        log = json.loads((out_dir / run["log"]).read_text())
        assert log["config"]["world_size"] == 2 and log["config"]["steps"] == 16
        assert run["val_loss"] == log["final"]["val_loss"] < 5.0  # it learned from ln(256) = 5.55
    # The flags reached the library: fragments sync in more collectives, int8 sends 1 byte a float.
    assert doc["configs"]["k16-p4t2-int8ef"]["runs"]["0"]["collectives"] > base["runs"]["0"]["collectives"]
    assert new["mb_sent_per_rank"] < 0.5 * base["mb_sent_per_rank"]
    (pair,) = doc["pairs"]
    assert (pair["new"], pair["base"], pair["role"]) == ("k16-p4t2-int8ef", "k16", "test")
    want = 100 * (new["runs"]["0"]["val_loss"] - base["runs"]["0"]["val_loss"]) / base["runs"]["0"]["val_loss"]
    assert pair["gap_pct_per_seed"] == pytest.approx([want])
    assert "avg K=16 P=4 tau=2 int8+EF" in doc["table"] and (out_dir / "compose.md").exists()


def _fake_log(out, name, seed, val, mb):
    path = cc.log_path(str(out), name, seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    final = {"val_loss": val, "bytes": mb * 1e6, "syncs": 4, "collectives": 8, "wall_s": 1.0,
             "param_checksums": [1.5, 1.5]}
    with open(path, "w") as fh:
        json.dump({"final": final, "curve": [{"step": 0, "val_loss": 5.5}, {"step": 8, "val_loss": val}],
                   "config": {"world_size": 2, "backend": "gloo", "params": 1000, "steps": 8}}, fh)


def test_summary_pairs_by_seed_and_reports_the_spread(tmp_path):
    """Three seeds: the gap is taken seed by seed (not of the means), with its std and range."""
    base = {0: 2.0, 1: 2.2, 2: 1.8}
    new = {0: 2.02, 1: 2.2, 2: 1.89}
    for s in base:
        _fake_log(tmp_path, "k16", s, base[s], 4.0)
        _fake_log(tmp_path, "k16-p4t2-int8ef", s, new[s], 1.0)
    summary = cc.summarize(["k16", "k16-p4t2-int8ef"], [0, 1, 2], str(tmp_path))
    (pair,) = summary["pairs"]
    assert pair["gap_pct_per_seed"] == pytest.approx([1.0, 0.0, 5.0])
    assert pair["gap_pct"]["mean"] == pytest.approx(2.0)
    assert pair["gap_pct"]["std"] == pytest.approx(2.6457513, rel=1e-6)
    assert (pair["gap_pct"]["min"], pair["gap_pct"]["max"]) == pytest.approx((0.0, 5.0))
    assert pair["bytes_ratio"] == pytest.approx(0.25)
    v = summary["configs"]["k16"]["val_loss"]
    assert (v["mean"], v["min"], v["max"]) == pytest.approx((2.0, 1.8, 2.2))
    text = cc.table(summary, 3)
    assert "+2.00%" in text and "0.25x" in text and "1.8000..2.2000" in text


def test_ranks_that_end_apart_are_flagged(tmp_path):
    _fake_log(tmp_path, "k16", 0, 2.0, 4.0)
    path = cc.log_path(str(tmp_path), "k16", 0)
    doc = json.load(open(path))
    doc["final"]["param_checksums"] = [1.5, 1.25]
    json.dump(doc, open(path, "w"))
    assert cc.summarize(["k16"], [0], str(tmp_path))["configs"]["k16"]["runs"]["0"]["ranks_agree"] is False


@pytest.mark.parametrize("argv, says", [
    (["--only", "k16,k32"], "unknown configuration"),
    (["--seeds", "0,x"], "comma-separated integers"),
    (["--nproc", "1"], "--nproc must be >= 2"),
])
def test_bad_arguments_say_what_to_change(argv, says, capsys):
    with pytest.raises(SystemExit):
        cc.parse_args(argv)
    assert says in capsys.readouterr().err


def test_a_failing_run_stops_the_campaign_with_its_output(tmp_path):
    """A flag the demo rejects: the tool exits non-zero with the run's own error, no summary."""
    rc, out = run_tool(["--only", "k16", "--seeds", "0", "--steps", "4", "--timeout", "60",
                        "--out", str(tmp_path), "--", "--no-such-flag"], timeout=60)
    assert rc != 0
    assert "run failed" in out and "--no-such-flag" in out
    assert not (tmp_path / "compose.json").exists()
