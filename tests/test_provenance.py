"""Whose optimizer state is loaded, unsynced steps at the end of a script, a hung rank 0.

Between syncs every rank holds its own weights and inner moments; frameworks that give rank 0's
file to every rank must not do so silently (flodl_opt/provenance.py).
"""
import os
import signal
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
from torch import nn

import flodl_opt as flo
from dist_harness import launcher_env, run_launcher, run_ranks

K = 3


def _build(seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model,
                                sync_every=kw.pop("sync_every", K), **kw)
    return model, opt


def _steps(rank, model, opt, first, last):
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(1000 * rank + step)
        opt.zero_grad()
        model(torch.randn(6, 4, generator=g)).square().mean().backward()
        opt.step()


def _caught(fn, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    return out, caught


def _of(caught, cls):
    return [str(w.message) for w in caught if issubclass(w.category, cls)]


# ---------------------------------------------------------------- the record
def _record_rank(rank, world):
    model, opt = _build()
    _steps(rank, model, opt, 1, 4)          # synced at 3: one step after it
    between = opt.state_dict()["flodl_opt"]["saved_by"]
    _steps(rank, model, opt, 5, 6)          # synced at 6
    at_sync = opt.state_dict()["flodl_opt"]["saved_by"]
    return between, at_sync


def test_state_dict_records_the_saving_rank_world_steps_and_consensus():
    for rank, (between, at_sync) in enumerate(run_ranks(_record_rank, 2, timeout=60)):
        assert (between["rank"], between["world"], between["local_steps"], between["sync_count"],
                between["steps_since_sync"], between["consensus"]) == (rank, 2, 4, 1, 1, False)
        assert (at_sync["local_steps"], at_sync["global_steps"], at_sync["sync_count"],
                at_sync["steps_since_sync"], at_sync["consensus"], at_sync["in_flight"]) == (6, 12, 2, 0, True, False)


# ---------------------------------------------------------------- another rank's state
def _load_rank0_state_rank(rank, world, outer):
    """Every rank loads rank 0's model and optimizer state, as a framework resume does."""
    out = {}
    for name, last in (("between", 4), ("at_sync", 6)):
        model, opt = _build(outer=outer)
        _steps(rank, model, opt, 1, last)
        saved = flo.broadcast_object((model.state_dict(), opt.state_dict()), root_rank=0)
        model2, opt2 = _build(seed=5, outer=outer)
        model2.load_state_dict(saved[0])
        _, caught = _caught(opt2.load_state_dict, saved[1])
        out[name] = [(w.category.__name__, str(w.message)) for w in caught
                     if issubclass(w.category, flo.InexactResumeWarning)]
    return out


@pytest.mark.parametrize("outer", [None, "easgd"])
def test_loading_another_ranks_state_warns_between_syncs_and_of_moments_at_a_sync(outer):
    rank0, rank1 = run_ranks(_load_rank0_state_rank, 2, outer, timeout=90)
    assert rank0 == {"between": [], "at_sync": []}  # its own state: exact, nothing to say
    (cls, msg), = rank1["between"]
    assert cls == "ForeignRankStateWarning"
    assert "rank 1 resumes from the optimizer state saved by rank 0 of 2 at local step 4" in msg
    assert "1 step(s) since the last sync are lost" in msg and "opt.sync()" in msg
    (cls, msg), = rank1["at_sync"]
    if outer == "easgd":  # EASGD ranks keep weights of their own after a sync: never a consensus
        assert cls == "ForeignRankStateWarning"
    else:
        assert cls == "ForeignMomentsWarning"
        assert "a consensus point" in msg and "moments are rank 0's" in msg and "flo.save_checkpoint" in msg


def test_a_state_dict_without_the_record_loads_as_before():
    flo.init()
    model, opt = _build()
    _steps(0, model, opt, 1, 4)
    sd = opt.state_dict()
    del sd["flodl_opt"]["saved_by"]          # as saved before the record existed
    model2, opt2 = _build(seed=5)
    _, caught = _caught(opt2.load_state_dict, sd)
    assert _of(caught, flo.InexactResumeWarning) == []
    assert opt2.state_dict()["flodl_opt"]["counters"] == opt.state_dict()["flodl_opt"]["counters"]


def test_a_state_dict_without_the_flodl_opt_entry_is_refused():
    flo.init()
    model, opt = _build()
    with pytest.raises(flo.ConfigError, match="no 'flodl_opt' entry.*opt.optimizer.load_state_dict"):
        opt.load_state_dict(opt.optimizer.state_dict())


def test_a_mix_of_tensors_is_refused_and_strict_false_warns():
    flo.init()
    model, opt = _build()
    _steps(0, model, opt, 1, 4)
    sd = opt.state_dict()
    sd["state"][0]["exp_avg_sq"] = sd["state"][0]["exp_avg_sq"] * 1.5  # another rank's, as it were
    before = [t.clone() for t in opt.optimizer.state[next(model.parameters())].values()]
    with pytest.raises(flo.ConfigError, match=r"per-tensor mix of several ranks' state.*flo.DCPState"):
        opt.load_state_dict(sd)
    after = list(opt.optimizer.state[next(model.parameters())].values())
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # refused: nothing written
    _, caught = _caught(opt.load_state_dict, sd, strict=False)
    assert len(_of(caught, flo.InexactResumeWarning)) == 1


def test_loading_the_optimizer_without_its_model_warns():
    flo.init()
    model, opt = _build()
    _steps(0, model, opt, 1, 4)
    sd = opt.state_dict()
    model2, opt2 = _build(seed=5)
    _, caught = _caught(opt2.load_state_dict, sd)  # the model was never loaded
    msg, = _of(caught, flo.InexactResumeWarning)
    assert "other weights than the model holds now" in msg and "load the model first" in msg
    model2.load_state_dict(model.state_dict())
    _, caught = _caught(opt2.load_state_dict, sd)
    assert _of(caught, flo.InexactResumeWarning) == []


# ---------------------------------------------------------------- DCP in place
def test_dcp_in_place_load_restores_a_wrapped_model(tmp_path):
    import torch.distributed.checkpoint as dcp
    flo.init()
    model, opt = _build()
    _steps(0, model, opt, 1, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(tmp_path))
        model2, opt2 = _build(seed=5)
        template = {"model": model2.state_dict(), "optim": opt2.state_dict()}
        dcp.load(template, checkpoint_id=str(tmp_path))  # no model2.load_state_dict(...) after it
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(opt2._param_groups_flat[0].flat, opt._param_groups_flat[0].flat)  # in the buffer


def test_a_wrapped_models_state_dict_pickles_as_a_plain_ordered_dict(tmp_path):
    from collections import OrderedDict
    flo.init()
    model, _ = _build()
    torch.save(model.state_dict(), tmp_path / "m.pt")
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert type(got) is OrderedDict and hasattr(got, "_metadata")
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- the end of a script
def _unsynced_shutdown_rank(rank, world, final_sync):
    model, opt = _build(sync_every=4)
    _steps(rank, model, opt, 1, 22)  # synced at 20: 2 steps after it
    if final_sync:
        opt.sync()
    _, caught = _caught(flo.shutdown)
    return _of(caught, flo.UnsyncedExitWarning)


@pytest.mark.parametrize("final_sync", [False, True])
def test_unsynced_steps_warn_at_shutdown_on_every_rank(final_sync):
    for rank, told in enumerate(run_ranks(_unsynced_shutdown_rank, 2, final_sync, timeout=60)):
        if final_sync:
            assert told == []
            continue
        msg, = told
        assert f"rank {rank}:" in msg and "2 step(s) since its last sync (sync #5)" in msg
        assert "Call opt.sync() on every rank" in msg and "flo.shutdown()" in msg


_EXIT_SCRIPT = '''
import sys, torch
from torch import nn
import flodl_opt as flo

flo.init()
torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, sync_every=4)
for step in range(22):
    g = torch.Generator().manual_seed(1000 * flo.rank() + step)
    opt.zero_grad()
    model(torch.randn(6, 4, generator=g)).square().mean().backward()
    opt.step()
if sys.argv[1] == "sync":
    opt.sync()
print(f"rank {flo.rank()} done", flush=True)
'''


@pytest.mark.launcher
@pytest.mark.parametrize("ending", ["nosync", "sync"])
def test_unsynced_steps_warn_at_interpreter_exit_on_every_rank(tmp_path, ending):
    script = tmp_path / "script.py"
    script.write_text(_EXIT_SCRIPT)
    out = run_launcher([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script), ending], launcher_env(), cwd=str(tmp_path), timeout=240)
    told = [line for line in out.splitlines() if "UnsyncedExitWarning" in line]
    if ending == "sync":
        assert told == [], out[-3000:]
        return
    for rank in (0, 1):
        mine = [line for line in told if f"rank {rank}:" in line]
        assert len(mine) == 1, out[-3000:]
        assert "2 step(s) since its last sync (sync #5)" in mine[0] and "interpreter exit" in mine[0]
        assert "Call opt.sync() on every rank" in mine[0]


# ---------------------------------------------------------------- a hung rank 0
def _rank0_hangs(rank, world):
    model, opt = _build(stall_warning_s=1.0)
    pids = [None] * world
    torch.distributed.all_gather_object(pids, os.getpid())
    torch.distributed.barrier()
    seen = {}
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # hung: the store it hosts with it
    else:
        def release():  # let rank 0 go once warned, or after 12 s (the old code never warns)
            start = time.monotonic()
            while not opt._stall.warnings and time.monotonic() - start < 12:
                time.sleep(0.05)
            seen["warnings"] = list(opt._stall.warnings)
            seen["after_s"] = time.monotonic() - start
            os.kill(pids[0], signal.SIGCONT)
        threading.Thread(target=release, daemon=True).start()
    opt.sync()
    return seen


def test_stall_warning_on_a_nonzero_rank_when_rank_0_hangs():
    _, seen = run_ranks(_rank0_hangs, 2, timeout=90, collective_timeout=40)
    assert seen["warnings"], "no stall warning within 12 s while rank 0 was stopped"
    msg = seen["warnings"][0]
    assert "rank 1 has waited" in msg and "sync #1" in msg
    assert "store is not answering" in msg and "rank 0" in msg
    assert seen["after_s"] < 8
