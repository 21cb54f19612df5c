"""The README's demo, examples/train_charlm.py: it launches its own ranks, trains, and logs honestly."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_charlm.py")


def load_example():
    from dist_harness import load_script
    return load_script("train_charlm", EXAMPLE)


def run_example(args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # two ranks on this machine's CPU, even on a one-GPU box
    proc = subprocess.Popen([sys.executable, EXAMPLE, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the example and the ranks it spawned
        out, _ = proc.communicate()
        pytest.fail(f"train_charlm did not finish within {timeout}s:\n{out}")
    assert proc.returncode == 0, f"train_charlm failed (exit {proc.returncode}):\n{out}"
    return out


TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--context", "32", "--batch-size", "8",
        "--corpus-mb", "0.2", "--warmup", "4", "--lr", "3e-3", "--eval-batches", "4"]


def test_two_ranks_launch_themselves_and_log_the_curve(tmp_path):
    log = tmp_path / "curve.json"
    # 22 steps with K=4: syncs after steps 4..20, then the closing sync at step 22.
    out = run_example(["--nproc", "2", "--steps", "22", "--sync-every", "4", "--eval-every", "8",
                       *TINY, "--log", str(log)])
    assert "2 rank(s) on gloo" in out
    res = json.loads(log.read_text())
    assert res["config"]["world_size"] == 2
    curve = res["curve"]
    assert [p["step"] for p in curve] == [0, 8, 16, 22]
    vals = [p["val_loss"] for p in curve]
    assert vals[0] > 5.0, vals                       # ~ln(256) before training
    assert vals[-1] < vals[0] - 1.0, vals            # it learned
    assert all(torch.isfinite(torch.tensor(p["train_loss"])) for p in curve[1:])
    # Communication accounting: 6 syncs, each a tiny count plus one float32 reduce of all params,
    # every tensor padded to a 256-byte (64-element) boundary in the flat buffer.
    cfg = res["config"]
    model = load_example().CharLM(256, cfg["d_model"], cfg["heads"], cfg["layers"], cfg["context"])
    padded = sum(-(-p.numel() // 64) * 64 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == cfg["params"]
    assert [p["syncs"] for p in curve] == [0, 2, 4, 6]
    final = res["final"]
    assert final["collectives"] == 2 * 6
    per_sync, rest = divmod(final["bytes"], 6)
    assert rest == 0 and 0 < per_sync - 4 * padded <= 128, (final["bytes"], padded)
    assert final["tokens_per_s"] > 0
    a, b = final["param_checksums"]
    assert a == b  # the run ends on the consensus: both ranks hold the same weights


@pytest.mark.skipif(not hasattr(__import__("flodl_opt"), "DistributedOptimizer"),
                    reason="flodl_opt.DistributedOptimizer is not available")
def test_allreduce_baseline_mode(tmp_path):
    log = tmp_path / "curve.json"
    run_example(["--nproc", "2", "--mode", "allreduce", "--steps", "12", "--eval-every", "6",
                 *TINY, "--log", str(log)])
    res = json.loads(log.read_text())
    vals = [p["val_loss"] for p in res["curve"]]
    assert vals[-1] < vals[0] - 0.3, vals
    final, n = res["final"], res["config"]["params"]
    assert (final["syncs"], final["collectives"], final["bytes"]) == (12, 12, 12 * 4 * n)
    a, b = final["param_checksums"]
    assert a == b  # averaged gradients, identical steps: identical weights every step


def test_corpus_split_and_model_are_deterministic_and_causal():
    ex = load_example()
    data = ex.stdlib_corpus(100_000)
    assert data == ex.stdlib_corpus(100_000) and len(data) == 100_000
    train, val = ex.split(data, block=1000, every=10)
    assert train.numel() + val.numel() == len(data) and val.numel() == 10 * 1000
    # Validation blocks are the 10th, 20th, ... blocks of the text, disjoint from training.
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    assert torch.equal(val[:1000], raw[9000:10000]) and torch.equal(train[9000:10000], raw[10000:11000])
    torch.manual_seed(0)
    model = ex.CharLM(256, d=32, heads=2, layers=1, context=16).eval()
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256                 # change only the future
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])
