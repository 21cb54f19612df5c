"""Faults, counted: the quickest trial of each kind of tools/fault_campaign.py, and the checkpoint seal.

The seal tests run in this process. The trials (marker ``faults``; deselect with ``-m "not faults"``)
run the campaign's own job and judges: a SIGKILL then a SIGSTOP in one torchrun job (two restarts),
and a damaged checkpoint of each kind plus a NaN rank on real Gloo ranks from the test harness.
The uninterrupted reference is the same job on harness ranks, so the torchrun trials are also
checked against an independent launch.
"""
from __future__ import annotations

import json
import os
import random
import sys
import zipfile

import pytest
import torch
from torch import nn

import flodl_opt as flo
from flodl_opt import checkpoint as ckpt_mod
from dist_harness import ROOT, RankFailure, run_ranks

sys.path.insert(0, os.path.join(ROOT, "tools"))
import fault_campaign as fc  # noqa: E402
import fault_job  # noqa: E402

STEPS, K = 24, 4
CFG = fc.Config(steps=STEPS, sync_every=K, stop_timeout_s=10.0, stall_warning_s=3.0, snapshot_at=12,
                attempt_deadline_s=120.0)


# ------------------------------------------------------------------ the seal (one process)
def _saved(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model, sync_every=1)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    path = str(tmp_path / "last.pt")
    flo.save_checkpoint(path, model, opt, extra={"step": 1})
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def _fresh():
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model, sync_every=1)


def test_every_flipped_bit_and_every_truncation_is_refused_naming_the_file(tmp_path):
    path, _ = _saved(tmp_path)
    raw = open(path, "rb").read()
    assert zipfile.ZipFile(path).testzip() is None and torch.load(path, weights_only=False)["version"] == 2
    rng = random.Random(0)
    # Random spots, plus the end of the file: the zip's end record and the seal itself.
    spots = [rng.randrange(len(raw)) for _ in range(16)] + list(range(len(raw) - 90, len(raw)))
    bad = str(tmp_path / "bad.pt")
    model, opt = _fresh()   # a refused file changes nothing: one model serves every load
    for pos in spots:
        data = bytearray(raw)
        data[pos] ^= 1 << rng.randrange(8)
        open(bad, "wb").write(data)
        with pytest.raises(RuntimeError, match=r"bad\.pt (is damaged|cannot be read)"):
            flo.load_checkpoint(bad, model, opt)
    for n in (0, 1, len(raw) // 3, len(raw) - 80, len(raw) - 1):
        open(bad, "wb").write(raw[:n])
        with pytest.raises(RuntimeError, match=r"bad\.pt (is damaged|cannot be read)"):
            flo.load_checkpoint(bad, model, opt)
    assert flo.load_checkpoint(path, model, opt) == {"step": 1}   # the intact file still loads


def test_a_flip_inside_a_tensor_is_refused_where_torch_load_reads_garbage(tmp_path):
    path, state = _saved(tmp_path)
    raw = bytearray(open(path, "rb").read())
    w = state["0.weight"].flatten()
    pos = bytes(raw).find(w[5:9].numpy().tobytes())   # the bytes of four weights, in the file
    assert pos > 0
    raw[pos] ^= 0x10
    open(path, "wb").write(raw)
    loaded = torch.load(path, weights_only=False)["model"]["0.weight"].flatten()
    assert not torch.equal(loaded, w)                 # torch.load alone: a silent wrong weight
    with pytest.raises(RuntimeError, match=r"last\.pt is damaged: its CRC32 is"):
        flo.load_checkpoint(path, *_fresh())


def test_version_1_files_still_load_and_unsealed_version_2_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_mod, "_seal", lambda f: None)
    monkeypatch.setattr(ckpt_mod, "FORMAT_VERSION", 1)
    path, state = _saved(tmp_path)                    # as flodl_opt wrote them before the seal
    monkeypatch.undo()
    model, opt = _fresh()
    assert flo.load_checkpoint(path, model, opt) == {"step": 1}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    monkeypatch.setattr(ckpt_mod, "_seal", lambda f: None)
    path, _ = _saved(tmp_path)                        # version 2 without its seal: damaged
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="checksum seal is missing or altered"):
        flo.load_checkpoint(path, *_fresh())


# ------------------------------------------------------------------ trials (real ranks)
def _job(rank, world, argv):
    fault_job.train(fault_job.parse_args(argv))


def harness_runner(job_dir, world, args, faults, deadline_s):
    """The campaign's job on harness ranks (one attempt, no launcher): for load-time and NaN trials."""
    import time
    t0 = time.monotonic()
    rc, hang, out = 0, False, ""
    try:
        run_ranks(_job, world, args, timeout=deadline_s, env={fault_job.FAULT_ENV: json.dumps(faults)})
    except RankFailure as exc:
        rc, out = 1, str(exc)
        hang = "did not finish" in out
    return fc.JobResult(None if hang else rc, hang, time.monotonic() - t0, out, job_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job_dir = str(tmp_path_factory.mktemp("reference"))
    res = harness_runner(job_dir, 2, fc.job_args(CFG, job_dir, 60.0, snapshot_at=CFG.snapshot_at), [], 120)
    assert res.rc == 0, res.output
    return fc.load_reference(job_dir)


def _explain(trials, res):
    return "\n".join(fc.row(t) for t in trials) + f"\n--- job output ---\n{res.output[-6000:]}"


@pytest.mark.faults
@pytest.mark.launcher
def test_sigkill_then_sigstop_under_torchrun_resume_bit_exact(tmp_path, reference):
    rng = random.Random()
    kill_step = rng.randrange(K + 1, 2 * K + 1)
    stop_step = rng.randrange(kill_step + K + 2, kill_step + 2 * K + 2)
    trials = [fc.Trial(0, "kill", 2, rng.randrange(2), kill_step, rng.choice(fc.INNER_PHASES), 0),
              fc.Trial(1, "stop", 2, rng.randrange(2), stop_step, "optimizer", 1)]
    res = fc.run_job(trials, {2: reference}, CFG, str(tmp_path))
    kill, stop = trials
    why = _explain(trials, res)
    assert not res.hang and res.rc == 0, why
    for t in trials:
        assert t.recovered and t.exact and not t.hang, why
        assert 0 <= t.steps_lost <= K and len(t.checked_steps) >= 2, why   # resume + a later consensus
    assert kill.resumed_from == kill_step // K * K, why
    # The hung peer: the other rank raised SyncError naming the sync, within the timeout + margin,
    # and the stall watchdog named the stopped rank first.
    assert CFG.stop_timeout_s * 0.8 <= stop.detect_s <= CFG.stop_timeout_s + fc.DETECT_MARGIN_S, why
    assert stop.detail["stall_warning_named_it"], why


@pytest.mark.faults
def test_damaged_checkpoints_are_refused_and_a_nan_rank_gets_no_vote(tmp_path, reference):
    rng = random.Random()
    trials = [fc.Trial(i, "damage", 2, rng.randrange(2), CFG.snapshot_at - 1, how, i, {"draw": rng.random()})
              for i, how in enumerate(fc.DAMAGES)]
    trials.append(fc.Trial(3, "nan", 2, rng.randrange(2), rng.randrange(K + 1, STEPS - 2 * K), "loss", 3))
    res = fc.run_job(trials, {2: reference}, CFG, str(tmp_path), runner=harness_runner)
    why = _explain(trials, res)
    assert res.rc == 0 and not res.hang, why
    for t in trials[:3]:
        assert t.detail["detected"] and t.recovered and t.exact, why
        assert t.resumed_from == CFG.snapshot_at - K and t.steps_lost == K, why
    nan = trials[3]
    assert nan.recovered and nan.detail["warned"] and nan.detail["ranks_identical"], why
    assert nan.loss_diff is not None and abs(nan.loss_diff) < 0.5, why
