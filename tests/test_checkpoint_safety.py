"""Checkpoints that are safe and never silent.

* A crafted checkpoint runs no code on load (unsealed, sealed with a recomputed CRC32, an object
  at the top level, a raw pickle): it is refused on every rank and its payload never runs.
* A refused load writes nothing (model, optimizer state, counters bit-identical), on every rank.
* A failed last background save is reported at shutdown and at exit, on every rank, non-zero.
* A killed write's temp file is removed by the next save of the same checkpoint (only ours).
* A peer dying inside save_checkpoint / load_checkpoint gives a SyncError, not a raw Gloo error.

Multi-rank cases run on real Gloo ranks (tests/dist_harness.py) or real processes, with timeouts.
"""
from __future__ import annotations

import copy
import dataclasses
import fcntl
import functools
import os
import pickle
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import flodl_opt as flo
from flodl_opt import checkpoint as ckpt_mod
from dist_harness import ROOT, free_port, run_ranks, survivor_verdict, sync_error_verdict


# ------------------------------------------------------------------ helpers
def _build(sync_every=2, outer=None, width=3, stall_warning_s=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, width), nn.BatchNorm1d(width))
    opt = flo.LocalSGDOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model=model,
                                sync_every=sync_every, outer=outer, stall_warning_s=stall_warning_s)
    return model, opt


def _train(model, opt, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(8, 5, generator=g)).pow(2).mean().backward()
        opt.step()


def _snapshot(model, opt):
    """Everything a load could write: params and buffers, the optimizer's whole state dict."""
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": copy.deepcopy(opt.state_dict()),
            "counters": (opt.local_steps, opt.steps_since_sync, opt.sync_count)}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class _RunsCode:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def _good_payload(tmp_path) -> dict:
    model, opt = _build()
    _train(model, opt, 2)
    good = str(tmp_path / "good.pt")
    flo.save_checkpoint(good, model, opt, extra={"step": 2})
    return torch.load(good, weights_only=True)


def _craft(kind: str, tmp_path, marker: str) -> str:
    """A checkpoint whose unpickling would create ``marker``."""
    path = str(tmp_path / f"{kind}.pt")
    evil = _RunsCode(marker)
    if kind in ("unsealed", "sealed"):
        payload = _good_payload(tmp_path)
        payload["ranks"][0]["extra"] = {"step": 2, "x": evil}
        if kind == "unsealed":          # as a version 1 file (written before the seal): no seal needed
            payload["version"] = 1
            torch.save(payload, path)
        else:                           # version 2 with a valid seal: the CRC32 is recomputed
            ckpt_mod.atomic_save(payload, path)
            assert ckpt_mod._check_seal(path) is None
    elif kind == "top-level object":
        torch.save(evil, path)
    elif kind == "top-level object, sealed":
        ckpt_mod.atomic_save(evil, path)
    elif kind == "raw pickle":
        with open(path, "wb") as f:
            pickle.dump(evil, f)
    else:
        raise AssertionError(kind)
    return path


CRAFTED = ["unsealed", "sealed", "top-level object", "top-level object, sealed", "raw pickle"]


# ------------------------------------------------------------------ 1. no code runs on load
@pytest.mark.parametrize("kind", CRAFTED)
def test_crafted_checkpoint_is_refused_and_runs_no_code(tmp_path, kind):
    marker = str(tmp_path / "code_ran")
    path = _craft(kind, tmp_path, marker)
    model, opt = _build()
    _train(model, opt, 2, seed=1)
    before = _snapshot(model, opt)
    with pytest.raises(RuntimeError, match=rf"{kind}\.pt (is refused|cannot be read)") as info:
        flo.load_checkpoint(path, model, opt)
    assert not os.path.exists(marker), "the checkpoint's payload ran"
    msg = str(info.value)
    if kind == "raw pickle":
        assert "not a zip archive" in msg and "without unpickling it" in msg
    else:
        assert "posix.system" in msg and "could run any code" in msg and "trusted=True" in msg
    after = _snapshot(model, opt)
    assert _same(before, after)


def _load_crafted_and_good(rank, world, crafted, marker, good):
    model, opt = _build()
    try:
        flo.load_checkpoint(crafted, model, opt)
    except RuntimeError as exc:
        refused = str(exc)
    else:
        refused = None
    ran = os.path.exists(marker)
    extra = flo.load_checkpoint(good, model, opt)          # default: weights_only=True
    _train(model, opt, 2, seed=rank)                        # trains on, in lock-step
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    return {"refused": refused, "ran": ran, "extra": extra, "flat": flat}


def _save_two_ranks(rank, world, path):
    model, opt = _build()
    _train(model, opt, 2, seed=rank)
    extra = {"step": 2, "rank": rank, "np": np.arange(3, dtype=np.float32) + rank, "np_scalar": np.int64(7),
             "set": {1, 2}, "tuple": (1, "a"), "bytes": b"\x00\x01", "t": torch.tensor([rank])}
    flo.save_checkpoint(path, model, opt, extra=extra)
    return True


def test_two_gloo_ranks_refuse_a_crafted_file_and_load_a_good_one_weights_only(tmp_path):
    good = str(tmp_path / "two.pt")
    run_ranks(_save_two_ranks, 2, good, timeout=90)
    torch.load(good, weights_only=True)                     # the file is plain data
    marker = str(tmp_path / "code_ran")
    crafted = _craft("sealed", tmp_path, marker)
    out = run_ranks(_load_crafted_and_good, 2, crafted, marker, good, timeout=90)
    for rank, r in enumerate(out):
        assert not r["ran"], f"rank {rank} ran the crafted file's code"
        assert r["refused"] and "failed on rank(s) [0, 1]" in r["refused"] and "sealed.pt is refused" in r["refused"]
        e = r["extra"]
        assert e["rank"] == rank and e["step"] == 2 and e["set"] == {1, 2} and e["tuple"] == (1, "a")
        assert isinstance(e["np"], np.ndarray) and e["np"].dtype == np.float32
        assert np.array_equal(e["np"], np.arange(3, dtype=np.float32) + rank)
        assert type(e["np_scalar"]) is np.int64 and e["np_scalar"] == 7 and e["bytes"] == b"\x00\x01"
    assert np.array_equal(out[0]["flat"], out[1]["flat"])
    model, opt = _build()                                   # 2 -> 1 rank, in this process
    extra = flo.load_checkpoint(good, model, opt)
    assert extra["rank"] == 0 and np.array_equal(extra["np"], np.arange(3, dtype=np.float32))
    assert not os.path.exists(marker)


@dataclasses.dataclass
class _Cfg:
    lr: float = 0.1


def test_extra_that_is_not_plain_data_is_refused_at_save(tmp_path):
    model, opt = _build()
    _train(model, opt, 2)
    path = tmp_path / "c.pt"
    with pytest.raises(flo.ConfigError, match=r"extra\['cfg'\] is a .*_Cfg.*dataclasses\.asdict"):
        flo.save_checkpoint(path, model, opt, extra={"step": 2, "cfg": _Cfg()})
    assert not os.listdir(tmp_path), "something was written"


def test_trusted_load_of_an_old_file_with_objects_warns_and_default_refuses(tmp_path):
    payload = _good_payload(tmp_path)
    payload["ranks"][0]["extra"] = {"step": 2, "cfg": _Cfg(0.5)}   # what an older flodl_opt wrote
    path = str(tmp_path / "old.pt")
    ckpt_mod.atomic_save(payload, path)
    with pytest.raises(RuntimeError, match=r"old\.pt is refused.*_Cfg.*trusted=True"):
        flo.load_checkpoint(path, *_build())
    with pytest.warns(ckpt_mod.UnsafeCheckpointWarning, match="arbitrary code execution"):
        extra = flo.load_checkpoint(path, *_build(), trusted=True)
    assert extra == {"step": 2, "cfg": _Cfg(0.5)}
    with pytest.warns(ckpt_mod.UnsafeCheckpointWarning):
        flo.load_checkpoint(path, *_build(), weights_only=False)


def test_keyed_seal_refuses_a_tampered_file(tmp_path):
    model, opt = _build()
    _train(model, opt, 2)
    path = str(tmp_path / "k.pt")
    flo.save_checkpoint(path, model, opt, extra={"step": 2}, key=b"secret")
    assert flo.load_checkpoint(path, *_build(), key=b"secret") == {"step": 2}
    assert flo.load_checkpoint(path, *_build()) == {"step": 2}          # without a key: the CRC32 only
    with pytest.raises(RuntimeError, match=r"k\.pt is refused: its HMAC-SHA256 does not verify"):
        flo.load_checkpoint(path, *_build(), key=b"other")
    # Someone without the key changes the file and seals it again (a valid CRC32, no HMAC) ...
    payload = torch.load(path, weights_only=True)
    payload["ranks"][0]["extra"] = {"step": 999}
    ckpt_mod.atomic_save(payload, path)
    assert flo.load_checkpoint(path, *_build()) == {"step": 999}        # the CRC32 cannot tell
    with pytest.raises(RuntimeError, match=r"k\.pt is refused: it carries no HMAC"):
        flo.load_checkpoint(path, *_build(), key=b"secret")
    # ... or with a key of their own.
    ckpt_mod.atomic_save(payload, path, key=b"guess")
    model2, opt2 = _build()
    before = _snapshot(model2, opt2)
    with pytest.raises(RuntimeError, match="does not verify with this key"):
        flo.load_checkpoint(path, model2, opt2, key="secret")
    assert _same(before, _snapshot(model2, opt2))


# ------------------------------------------------------------------ 2. a refused load writes nothing
def _saved(tmp_path, **kw):
    model, opt = _build(**kw)
    _train(model, opt, 4)
    path = str(tmp_path / "saved.pt")
    flo.save_checkpoint(path, model, opt, extra={"step": 4})
    return path


def _target(case):
    if case == "another sync_every":
        return _build(sync_every=3)
    if case == "another outer":
        return _build(outer=None)
    return _build(width=4, outer=flo.DiLoCo(lr=0.7))   # another model shape


@pytest.mark.parametrize("case", ["another sync_every", "another outer", "another model shape"])
def test_failed_load_leaves_model_optimizer_and_counters_bit_identical(tmp_path, case):
    path = _saved(tmp_path, outer=flo.DiLoCo(lr=0.7))
    model, opt = _target(case)
    _train(model, opt, 6, seed=3)                          # its own state: moments, anchor, counters
    before = _snapshot(model, opt)
    with pytest.raises(flo.ConfigError):
        flo.load_checkpoint(path, model, opt)
    assert _same(before, _snapshot(model, opt)), "a refused load wrote something"


def _one_rank_refuses(rank, world, good, other):
    model, opt = _build()
    _train(model, opt, 6, seed=10 + rank)
    before = _snapshot(model, opt)
    try:   # rank 1 sees a file saved with another sync_every (as from a node-local copy)
        flo.load_checkpoint(good if rank == 0 else other, model, opt)
    except flo.ConfigError as exc:
        msg = str(exc)
    else:
        msg = None
    return {"msg": msg, "untouched": _same(before, _snapshot(model, opt))}


def test_load_refused_on_one_rank_writes_nothing_on_any_rank(tmp_path):
    good = _saved(tmp_path)
    other = str(tmp_path / "other.pt")
    model, opt = _build(sync_every=3)
    _train(model, opt, 3)
    flo.save_checkpoint(other, model, opt)
    out = run_ranks(_one_rank_refuses, 2, good, other, timeout=90)
    for rank, r in enumerate(out):
        assert r["msg"] and "failed on rank(s) [1]" in r["msg"] and "sync_every" in r["msg"], r["msg"]
        assert r["untouched"], f"rank {rank} was written although rank 1 refused the checkpoint"


# ------------------------------------------------------------------ 3. a failed last background save
_LAST_SAVE_FAILS = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {root!r})
    import flodl_opt as flo
    ckpt_dir, ending, simulate = sys.argv[1], sys.argv[2], sys.argv[3] == "simulate"
    flo.init(backend="gloo", timeout=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=1,
                                stall_warning_s=None)
    path = os.path.join(ckpt_dir, "last.pt")
    for step in range(3):
        model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
        # The last save's extra (4 MiB) does not fit on a small filesystem: the disk is full.
        blob = torch.zeros(1 << 20) if step == 2 else None
        if blob is not None and simulate:   # no small filesystem here: the writer fails as on one
            from flodl_opt import checkpoint as ck
            def disk_full(obj, f):
                raise OSError(28, "No space left on device")
            ck._serialize = disk_full
        flo.save_checkpoint(path, model, opt, extra={{"step": step + 1, "blob": blob}}, background=True)
    print("training done", flush=True)
    if ending == "shutdown":
        flo.shutdown()
    elif ending == "shutdown, error swallowed":
        try:
            flo.shutdown()
        except Exception:
            pass
""")


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs (a real full disk) where this process may mount one, else None (the
    script then makes its writer fail with ENOSPC)."""
    where = tmp_path / "small"
    where.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)], check=True,
                       capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        yield None
        return
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=20)


def _two_rank_script(tmp_path, script: str, args, timeout=120.0):
    """Run ``script`` as 2 real ranks (env:// rendezvous); return [(rc, output)] by rank."""
    path = tmp_path / "job.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    procs = [subprocess.Popen([sys.executable, str(path), *args], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    out = []
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return out


@pytest.mark.parametrize("ending", ["interpreter exit", "shutdown", "shutdown, error swallowed"])
def test_failed_last_background_save_is_reported_on_every_rank_and_exits_non_zero(tmp_path, small_disk, ending):
    simulate = small_disk is None
    if simulate:
        small_disk = str(tmp_path / "ck")
    out = _two_rank_script(tmp_path, _LAST_SAVE_FAILS.format(root=ROOT),
                           [small_disk, ending, "simulate" if simulate else "real"])
    target = os.path.join(small_disk, "last.pt")
    for rank, (rc, text) in enumerate(out):
        assert "training done" in text, text[-3000:]
        assert rc != 0, f"rank {rank} exited 0 after the last checkpoint write failed:\n{text[-3000:]}"
        assert target in text and "No space left on device" in text, text[-3000:]
        assert "last background checkpoint write failed" in text
        if ending == "interpreter exit":
            assert "flodl_opt: ERROR:" in text
    assert torch.load(target, weights_only=True)["ranks"][0]["extra"]["step"] == 2   # the one before
    assert [n for n in os.listdir(small_disk) if n != "last.pt"] == []               # no temp left


def test_successful_last_background_save_exits_zero_silently(tmp_path):
    ending = "interpreter exit"   # the longest path: rank 0 stays until rank 1 has read its word
    ck = str(tmp_path / "ck")
    out = _two_rank_script(tmp_path, _LAST_SAVE_FAILS.format(root=ROOT), [ck, ending, "real"])
    for rank, (rc, text) in enumerate(out):
        assert rc == 0 and "ERROR" not in text and "could not learn" not in text, text[-3000:]
    assert torch.load(os.path.join(ck, "last.pt"), weights_only=True)["ranks"][0]["extra"]["step"] == 3


def _wait_checkpoint_on_every_rank(rank, world, path):
    model, opt = _build()
    _train(model, opt, 2)
    real = ckpt_mod._serialize

    def disk_full(obj, f):
        raise OSError(28, "No space left on device")
    ckpt_mod._serialize = disk_full
    try:
        flo.save_checkpoint(path, model, opt, background=True)
        try:
            flo.wait_checkpoint()
        except (OSError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None
    finally:
        ckpt_mod._serialize = real


def test_wait_checkpoint_reports_rank_0s_failed_write_on_every_rank(tmp_path):
    path = str(tmp_path / "w.pt")
    out = run_ranks(_wait_checkpoint_on_every_rank, 2, path, timeout=90)
    assert out[0] and "No space left on device" in out[0]
    assert out[1] and path in out[1] and "No space left on device" in out[1] and "(on rank 0)" in out[1]


# ------------------------------------------------------------------ 4. a killed write's temp file
def test_stale_temp_of_a_killed_write_is_removed_at_the_next_save_and_only_it(tmp_path):
    from test_reliability import _KILLED_WRITER
    path, marker = str(tmp_path / "last.pt"), str(tmp_path / "halfway")
    script = tmp_path / "writer.py"
    script.write_text(_KILLED_WRITER.format(root=ROOT))
    child = subprocess.Popen([sys.executable, str(script), path, marker],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            assert child.poll() is None, child.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the writer never reached the middle of its write"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    torn = [n for n in os.listdir(tmp_path) if n.startswith(".last.pt.") and n.endswith(".tmp")]
    assert len(torn) == 1 and os.path.getsize(tmp_path / torn[0]) > 300_000
    decoys = [".other.pt.abcdefgh.tmp", ".last.pt.abcdefghi.tmp", ".last.pt.abcdefgh.tmp.bak",
              "last.pt.abcdefgh.tmp", ".last.pt.x.abcdefgh.tmp", ".last.pt.abcdefgh.tmpx"]
    for name in decoys:
        (tmp_path / name).write_bytes(b"not ours")
    live = tmp_path / ".last.pt.live0000.tmp"   # a write in flight: its writer holds the lock
    live.write_bytes(b"being written")
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        model = nn.Sequential(nn.Linear(512, 512))
        opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=1)
        assert flo.load_checkpoint(path, model, opt) == {"step": 0}
        flo.save_checkpoint(path, model, opt, extra={"step": 0})
    finally:
        os.close(held)
    left = sorted(os.listdir(tmp_path))
    assert torn[0] not in left, "the killed write's temp file is still there"
    assert set(decoys) | {live.name} <= set(left), "a file that is not a stale temp of last.pt was removed"


# ------------------------------------------------------------------ 5. a peer dies in a checkpoint collective
def _peer_dies_in(rank, world, out, where, ckpt):
    model, opt = _build()
    _train(model, opt, 2, seed=rank)
    if where == "load":
        flo.save_checkpoint(ckpt, model, opt, extra={"step": 2})
    before = _snapshot(model, opt)
    if rank == 1:
        def dies(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        setattr(dist, "gather_object" if where == "save" else "all_gather_object", dies)
    call = (lambda: flo.save_checkpoint(ckpt, model, opt, extra={"step": 2})) if where == "save" else \
        (lambda: flo.load_checkpoint(ckpt, model, opt))
    return sync_error_verdict(out, call, lambda exc: {
        "msg": str(exc), "type": type(exc).__name__, "rank": exc.rank, "restored": exc.restored,
        "cause": type(exc.cause).__name__, "untouched": _same(before, _snapshot(model, opt))})


@pytest.mark.parametrize("where", ["save", "load"])
def test_peer_dying_in_a_checkpoint_collective_raises_sync_error(tmp_path, where):
    out, ckpt = str(tmp_path / "verdict.pt"), str(tmp_path / "c.pt")
    r = survivor_verdict(functools.partial(_peer_dies_in, where=where, ckpt=ckpt), out, timeout=90)
    assert r["msg"] != "no error", "the survivor raised no SyncError"
    assert r["type"] == "CheckpointSyncError" and r["rank"] == 0 and r["restored"], r
    assert f"{where}_checkpoint({ckpt}) failed on rank 0" in r["msg"] and "resume from the last checkpoint" in r["msg"]
    assert r["untouched"]
    if where == "save":
        assert not os.path.exists(ckpt), "a checkpoint was written although a rank died"
