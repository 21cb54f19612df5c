"""Elastic restart and exact resume: a rank SIGKILLed under torchrun, and a changed world size.

The torchrun test runs examples/elastic_train.py as a user would; the reference ("never
interrupted") run is the same ``train()`` on real ranks from the test harness.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from torch import nn

import flodl_opt as flo
from dist_harness import ROOT, gather_object, run_ranks

EXAMPLE = os.path.join(ROOT, "examples", "elastic_train.py")
STEPS, K = 24, 4


def _example():
    from dist_harness import load_script
    return load_script("elastic_train", EXAMPLE)


def _train(rank, world, ckpt, steps, background=False):
    final = _example().train(ckpt, steps, sync_every=K, background=background)
    # numpy, not tensors: tensors put on a multiprocessing queue travel as shared-memory handles
    # that die with the rank process.
    return {k: v.numpy() for k, v in final.items()}


@pytest.fixture(scope="module")
def uninterrupted():
    """Final state of a 2-rank run that nothing interrupted (no checkpoints at all)."""
    finals = run_ranks(_train, 2, None, STEPS, timeout=120)
    _assert_same(finals[0], finals[1])   # the last sync left every rank with the same weights
    return finals[0]


def _assert_same(a, b):
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k]))]
    assert not diff, f"not bit-identical to the uninterrupted run: {diff}"


def test_torchrun_sigkill_mid_run_resumes_exactly(tmp_path, uninterrupted):
    rng = random.Random()
    kill_step, kill_rank = rng.randrange(K + 1, STEPS - 1), rng.randrange(2)
    ckpt, out, logs = tmp_path / "last.pt", tmp_path / "final.pt", tmp_path / "log"
    env = dict(os.environ, FLODL_KILL_AT_STEP=str(kill_step), FLODL_KILL_RANK=str(kill_rank),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
           EXAMPLE, "--ckpt", str(ckpt), "--out", str(out), "--log-dir", str(logs),
           "--steps", str(STEPS), "--sync-every", str(K)]
    proc = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=240)
    what = f"kill rank {kill_rank} at step {kill_step}"
    assert proc.returncode == 0, f"{what}: torchrun failed\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    # (The killed rank's peer fails at its next sync with SyncError, unless torchrun's SIGTERM
    # reaches it first; either way torchrun restarts both.)
    starts = {}
    for name in sorted(os.listdir(logs)):
        rec = json.loads((logs / name).read_text())
        starts[(rec["attempt"], rec["rank"])] = rec["start"]
    assert starts.get((0, 0)) == 0 and starts.get((0, 1)) == 0, starts
    resumed = (kill_step // K) * K   # the last consensus point before the kill
    assert starts.get((1, 0)) == resumed and starts.get((1, 1)) == resumed, (what, starts)
    assert 0 < resumed and kill_step - resumed < K   # at most one sync window of work lost
    _assert_same(torch.load(out), uninterrupted)


@pytest.fixture(scope="module")
def halfway(tmp_path_factory):
    """A checkpoint a 2-rank run wrote at step 12 (a consensus point), with background writes."""
    ckpt = str(tmp_path_factory.mktemp("halfway") / "last.pt")
    run_ranks(_train, 2, ckpt, 12, True, timeout=120)
    return ckpt


def test_resume_in_new_processes_is_exact_with_background_writes(tmp_path, halfway, uninterrupted):
    ckpt = str(tmp_path / "last.pt")
    with open(halfway, "rb") as src, open(ckpt, "wb") as dst:
        dst.write(src.read())
    finals = run_ranks(_train, 2, ckpt, STEPS, True, timeout=120)  # new processes resume from it
    _assert_same(finals[0], uninterrupted)
    _assert_same(finals[1], uninterrupted)


# ------------------------------------------------------------------ world size changes
def _check_resized(rank, world, ckpt):
    ex = _example()
    model, opt = ex.build(0, K)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    extra = flo.load_checkpoint(ckpt, model, opt)
    r0 = saved["ranks"][0]["optimizer"]
    # Replicated state as saved; per-rank inner state, counters and extra from rank 0's copy.
    for k, v in saved["model"].items():
        assert torch.equal(model.state_dict()[k], v), k
    for a, b in zip(opt.outer.anchor, saved["outer"]["anchor"]):
        assert torch.equal(a, b)
    ours = opt.optimizer.state_dict()["state"]
    for i, st in r0["state"].items():
        for k, v in st.items():
            assert torch.equal(ours[i][k], v), (i, k)
    assert opt.sync_count == r0["flodl_opt"]["counters"]["sync_count"]
    assert opt.lr_scheduler.last_epoch == r0["flodl_opt"]["lr_scheduler"]["last_epoch"]
    # Training goes on, in lock-step, in the new world.
    for step in range(extra["step"], extra["step"] + K):
        x, y = ex.batch(0, rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert opt.steps_since_sync == 0 and opt.last_sync.movers == world
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = gather_object(flat.numpy()) if world > 1 else [flat.numpy()]
    assert all((everyone[0] == f).all() for f in everyone)
    return extra


def test_world_size_changes_between_save_and_load(halfway):
    extras = run_ranks(_check_resized, 3, halfway, timeout=120)   # 2 -> 3 ranks
    assert extras == [{"step": 12}] * 3
    assert _check_resized(0, 1, halfway) == {"step": 12}          # 2 -> 1 rank (this process)
