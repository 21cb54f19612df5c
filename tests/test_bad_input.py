"""Bad input: every likely wrong call fails fast with a message that says what to change.

One row per wrong call. Rows that need one process run in the test process (a world of one);
rows about what ranks do to each other run on real Gloo ranks with a short collective timeout,
so a row that would hang fails the test instead (the harness kills it).
"""
from __future__ import annotations

import functools
import os
import re
import time

import pytest
import torch
from torch import nn

import flodl_opt as flo
from dist_harness import run_ranks


def _model(width=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2))


def _wrap(model=None, **kw):
    model = model or _model()
    return model, flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, **kw)


def _train(model, opt, n=1):
    dtype = next(model.parameters()).dtype
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(5, 3, dtype=dtype)).sum().backward()
        opt.step()


# ------------------------------------------------------------------ one process
def wrap_param_list():
    m = _model()
    flo.LocalSGDOptimizer(list(m.parameters()), model=m)


def wrap_twice():
    m, opt = _wrap()
    flo.LocalSGDOptimizer(opt, model=m)


def model_not_module():
    m = _model()
    flo.LocalSGDOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), model=m.state_dict())


def bad_kw(**kw):
    _wrap(**kw)


def outer_built_optimizer():
    m = _model()
    _wrap(m, outer=torch.optim.SGD(m.parameters(), lr=1.0))


def optimizer_params_not_in_model():
    m, other = _model(), _model(5)
    flo.LocalSGDOptimizer(torch.optim.SGD(list(m.parameters()) + list(other.parameters()), lr=0.1), model=m)


def model_params_missing_from_optimizer():
    m = _model()
    flo.LocalSGDOptimizer(torch.optim.SGD(m[0].parameters(), lr=0.1), model=m)


def scheduler_on_other_optimizer():
    m = _model()
    other = torch.optim.SGD(m.parameters(), lr=0.1)
    flo.LocalSGDOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), model=m,
                          lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 10))


def sparse_embedding():
    m = nn.Sequential(nn.Embedding(10, 4, sparse=True))
    flo.LocalSGDOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), model=m)


def add_param_group_after_wrapping():
    m, opt = _wrap()
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def model_moved_to_other_dtype():
    m, opt = _wrap(sync_every=1)
    m.double()
    _train(m, opt)


def model_moved_to_other_device():
    m, opt = _wrap()
    m.to("meta")
    opt.sync()


def param_replaced_after_wrapping():
    m, opt = _wrap(sync_every=1)
    m[0].weight = nn.Parameter(torch.randn(4, 3))
    _train(m, opt)


def param_data_rebound_after_wrapping():
    m, opt = _wrap()
    m[0].weight.data = torch.zeros(3, 4)  # another shape: no slot to adopt it into (same shape is adopted)
    opt.sync()


def load_state_dict_from_other_model():
    _, opt = _wrap()
    _, opt2 = _wrap(_model(8))
    opt2.load_state_dict(opt.state_dict())


def load_state_dict_from_other_config():
    _, opt = _wrap(sync_every=4)
    _, opt2 = _wrap(sync_every=8)
    opt2.load_state_dict(opt.state_dict())


def load_state_dict_from_other_outer():
    _, opt = _wrap(outer="diloco")
    _, opt2 = _wrap(outer="slowmo")
    opt2.load_state_dict(opt.state_dict(), strict=False)


def load_plain_optimizer_state_dict():
    m, opt = _wrap()
    opt.load_state_dict(torch.optim.SGD(m.parameters(), lr=0.1).state_dict())


def save_checkpoint_between_syncs(tmp):
    m, opt = _wrap(sync_every=4)
    _train(m, opt, 3)
    flo.save_checkpoint(os.path.join(tmp, "c.pt"), m, opt)


def save_checkpoint_plain_optimizer(tmp):
    m = _model()
    flo.save_checkpoint(os.path.join(tmp, "c.pt"), m, torch.optim.SGD(m.parameters(), lr=0.1))


def save_checkpoint_bad_path(tmp):
    m, opt = _wrap()
    flo.save_checkpoint(42, m, opt)


def load_checkpoint_missing(tmp):
    m, opt = _wrap()
    flo.load_checkpoint(os.path.join(tmp, "nope.pt"), m, opt)


def load_checkpoint_not_ours(tmp):
    m, opt = _wrap()
    torch.save(m.state_dict(), os.path.join(tmp, "c.pt"))
    flo.load_checkpoint(os.path.join(tmp, "c.pt"), m, opt)


def load_checkpoint_garbage(tmp):
    m, opt = _wrap()
    with open(os.path.join(tmp, "c.pt"), "wb") as f:
        f.write(b"PK\x03\x04 half a zip file")
    flo.load_checkpoint(os.path.join(tmp, "c.pt"), m, opt)


def load_checkpoint_other_model(tmp):
    m, opt = _wrap()
    flo.save_checkpoint(os.path.join(tmp, "c.pt"), m, opt)
    m2 = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.Linear(2, 2))
    _, opt2 = _wrap(m2)
    flo.load_checkpoint(os.path.join(tmp, "c.pt"), m2, opt2)


def init_timeout_wrong_type():
    flo.init(timeout="10s")


def init_timeout_negative():
    flo.init(timeout=-1)


def init_unknown_backend():
    flo.init(backend="mpi")


def used_before_init_under_launcher(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    _wrap()


ONE_PROCESS = [
    # (id, call, exception, what the message must say)
    ("optimizer is a param list", wrap_param_list, flo.ConfigError, r"torch\.optim\.Optimizer.*AdamW\(model\.parameters"),
    ("wrapped twice", wrap_twice, flo.ConfigError, r"wrap the inner optimizer once"),
    ("model is a state dict", model_not_module, flo.ConfigError, r"model must be an nn\.Module"),
    ("K = 0", functools.partial(bad_kw, sync_every=0), flo.ConfigError, r"sync_every must be an int >= 1"),
    ("K = -3", functools.partial(bad_kw, sync_every=-3), flo.ConfigError, r"sync_every must be an int >= 1"),
    ("K float", functools.partial(bad_kw, sync_every=2.5), flo.ConfigError, r"sync_every must be an int >= 1"),
    ("K string", functools.partial(bad_kw, sync_every="16"), flo.ConfigError, r"sync_every must be an int"),
    ("K bool", functools.partial(bad_kw, sync_every=True), flo.ConfigError, r"sync_every must be an int"),
    ("warmup < 0", functools.partial(bad_kw, warmup_steps=-1), flo.ConfigError, r"warmup_steps must be an int >= 0"),
    ("gamma < 0", functools.partial(bad_kw, gamma=-0.5), flo.ConfigError, r"gamma must be a number >= 0"),
    ("gamma string", functools.partial(bad_kw, gamma="1"), flo.ConfigError, r"gamma must be a number >= 0"),
    ("max_grad_norm 0", functools.partial(bad_kw, max_grad_norm=0), flo.ConfigError, r"max_grad_norm must be a number > 0"),
    ("unknown outer name", functools.partial(bad_kw, outer="adamw"), flo.ConfigError,
     r"unknown outer optimizer 'adamw'; use one of \['avg', 'diloco', 'easgd', 'slowmo'\]"),
    ("outer of wrong type", functools.partial(bad_kw, outer=3), flo.ConfigError, r"outer must be None, a name"),
    ("outer is a built optimizer", outer_built_optimizer, flo.ConfigError, r"functools\.partial\(torch\.optim\.SGD"),
    ("easgd without pre-sync copy", functools.partial(bad_kw, outer="easgd", keep_presync=False),
     flo.ConfigError, r"drop keep_presync=False"),
    ("optimizer params not in the model", optimizer_params_not_in_model, flo.ConfigError,
     r"not params of the model.*pass the model those params belong to"),
    ("model params missing from optimizer", model_params_missing_from_optimizer, flo.ConfigError,
     r"not in the optimizer.*Build the optimizer on model\.parameters\(\)"),
    ("scheduler on another optimizer", scheduler_on_other_optimizer, flo.ConfigError,
     r"scheduler built on the inner optimizer"),
    ("sparse embedding", sparse_embedding, flo.ConfigError, r"sparse=False"),
    ("add_param_group after wrapping", add_param_group_after_wrapping, flo.ConfigError,
     r"add the param group to the inner optimizer before wrapping"),
    ("model moved to another dtype after wrapping", model_moved_to_other_dtype, flo.ConfigError,
     r"moved after the optimizer was wrapped.*Move the model .* before building LocalSGDOptimizer"),
    ("model moved to another device after wrapping", model_moved_to_other_device, (RuntimeError, ValueError),
     r"(replaced|moved) after .*(Move the model|build the inner optimizer)"),
    ("param replaced after wrapping", param_replaced_after_wrapping, flo.ConfigError,
     r"'0\.weight' was replaced after LocalSGDOptimizer was built.*in place"),
    ("param .data rebound to another shape after wrapping", param_data_rebound_after_wrapping, flo.ConfigError,
     r"replaced or moved after the optimizer was wrapped.*shape \(3, 4\).*shape \(4, 3\).*param\.copy_"),
    ("load_state_dict from another model", load_state_dict_from_other_model, flo.ConfigError,
     r"different model.*build the same model"),
    ("load_state_dict from another config", load_state_dict_from_other_config, flo.ConfigError,
     r"'sync_every': \(4, 8\).*strict=False"),
    ("load_state_dict from another outer", load_state_dict_from_other_outer, flo.ConfigError,
     r"'outer': \('diloco', 'slowmo'\)"),
    ("load_state_dict of a plain optimizer", load_plain_optimizer_state_dict, flo.ConfigError,
     r"opt\.optimizer\.load_state_dict"),
    ("init timeout of wrong type", init_timeout_wrong_type, TypeError, r"timedelta or seconds.*init\(timeout=300\)"),
    ("init timeout negative", init_timeout_negative, ValueError, r"must be positive"),
    ("init unknown backend", init_unknown_backend, ValueError, r"'nccl' or 'gloo'"),
]

WITH_TMP = [
    ("save_checkpoint between syncs", save_checkpoint_between_syncs, flo.ConfigError,
     r"3 step\(s\) after the last sync.*opt\.steps_since_sync == 0.*sync=True"),
    ("save_checkpoint with a plain optimizer", save_checkpoint_plain_optimizer, flo.ConfigError,
     r"flo\.LocalSGDOptimizer\(opt, model=model\)"),
    ("save_checkpoint path not a path", save_checkpoint_bad_path, flo.ConfigError, r"str or os\.PathLike"),
    ("load_checkpoint missing file", load_checkpoint_missing, FileNotFoundError, r"missing_ok=True"),
    ("load_checkpoint of a plain state dict", load_checkpoint_not_ours, RuntimeError,
     r"not a flodl_opt checkpoint.*model\.load_state_dict"),
    ("load_checkpoint of a torn file", load_checkpoint_garbage, RuntimeError, r"cannot be read"),
    ("load_checkpoint into another model", load_checkpoint_other_model, flo.ConfigError,
     r"different model.*build the same model"),
]


@pytest.mark.parametrize("call, exc, says", [r[1:] for r in ONE_PROCESS], ids=[r[0] for r in ONE_PROCESS])
def test_bad_call_says_what_to_change(call, exc, says):
    with pytest.raises(exc, match="(?s)" + says):
        call()


@pytest.mark.parametrize("call, exc, says", [r[1:] for r in WITH_TMP], ids=[r[0] for r in WITH_TMP])
def test_bad_checkpoint_call_says_what_to_change(call, exc, says, tmp_path):
    with pytest.raises(exc, match="(?s)" + says):
        call(str(tmp_path))


def test_use_before_init_under_a_launcher(monkeypatch):
    with pytest.raises(RuntimeError, match=r"call flodl_opt\.init\(\) on every rank"):
        used_before_init_under_launcher(monkeypatch)


# ------------------------------------------------------------------ several ranks
def _outcome(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the row asserts the type and message
        return type(exc).__name__, str(exc)
    return None, None


def sync_on_one_rank_then_both_train(rank, world, tmp):
    """Rank 0 calls an extra sync(); then both train: rank 0's last sync has no partner."""
    m, opt = _wrap(sync_every=2, stall_warning_s=None)

    def go():
        _train(m, opt, 2)          # sync #1 everywhere
        if rank == 0:
            opt.sync()             # rank 0 only: it waits for rank 1's next step-sync
        _train(m, opt, 2)
    return _outcome(go)


def sync_on_one_rank_only(rank, world, tmp):
    """Rank 0 calls sync(); rank 1 never does, and stays alive: only the timeout can tell."""
    m, opt = _wrap(stall_warning_s=None)
    _train(m, opt, 1)
    done = os.path.join(tmp, "rank0_done")
    if rank == 0:
        out = _outcome(opt.sync)
        open(done, "w").close()
        return out
    deadline = time.monotonic() + 50
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)
    return None, None


def model_moved_on_one_rank(rank, world, tmp):
    m, opt = _wrap(sync_every=2, stall_warning_s=None)
    if rank == 1:
        m.double()
    return _outcome(lambda: _train(m, opt, 2))


# Rows that leave the process group usable run one after another on the same ranks.
def different_models(rank, tmp):
    _wrap(_model(4 + rank))


def different_sync_every(rank, tmp):
    _wrap(sync_every=4 + rank)


def different_outer(rank, tmp):
    _wrap(outer=["diloco", "avg"][rank])


def load_state_dict_on_one_rank(rank, tmp):
    """Rank 1 alone loads a state dict from later in training: the sync numbers disagree."""
    m, opt = _wrap(sync_every=2, stall_warning_s=None)
    _train(m, opt, 4)              # syncs #1, #2
    later = opt.state_dict()
    _train(m, opt, 2)              # sync #3
    if rank == 1:
        opt.load_state_dict(later)
    _train(m, opt, 2)


def save_checkpoint_between_syncs_everywhere(rank, tmp):
    m, opt = _wrap(sync_every=4, stall_warning_s=None)
    _train(m, opt, 1)
    flo.save_checkpoint(os.path.join(tmp, "c.pt"), m, opt)


def load_checkpoint_other_model_everywhere(rank, tmp):
    m, opt = _wrap(stall_warning_s=None)
    flo.save_checkpoint(os.path.join(tmp, "c2.pt"), m, opt)
    m2, opt2 = _wrap(_model(6), stall_warning_s=None)
    flo.load_checkpoint(os.path.join(tmp, "c2.pt"), m2, opt2)


def checkpoint_visible_on_some_ranks_only(rank, tmp):
    m, opt = _wrap(stall_warning_s=None)
    flo.save_checkpoint(os.path.join(tmp, "only0.pt"), m, opt)
    # Rank 1 looks where rank 0's file is not, as with a node-local disk.
    flo.load_checkpoint(os.path.join(tmp, f"only{rank}.pt"), m, opt)


SAME_GROUP = [
    # (id, fn, exception every rank must raise, what its message must say)
    ("different models on different ranks", different_models, "ConfigError",
     r"ranks wrap different models or configs.*Build the same model"),
    ("different sync_every on different ranks", different_sync_every, "ConfigError",
     r"'sync_every': 4.*'sync_every': 5.*Build the same model, optimizer and LocalSGDOptimizer"),
    ("different outer on different ranks", different_outer, "ConfigError", r"ranks wrap different models or configs"),
    ("load_state_dict on one rank only", load_state_dict_on_one_rank, "ConfigError",
     r"disagree on the sync number.*Load the same checkpoint on every rank"),
    ("save_checkpoint between syncs", save_checkpoint_between_syncs_everywhere, "ConfigError",
     r"after the last sync.*sync=True"),
    ("load_checkpoint into another model", load_checkpoint_other_model_everywhere, "ConfigError",
     r"different model.*build the same model"),
    ("checkpoint visible on some ranks only", checkpoint_visible_on_some_ranks_only, "RuntimeError",
     r"failed on rank\(s\) \[1\].*no file at .*only1\.pt.*a filesystem all ranks see"),
]


def _same_group_rows(rank, world, tmp):
    return {name: _outcome(functools.partial(fn, rank, tmp)) for name, fn, _, _ in SAME_GROUP}


@pytest.fixture(scope="module")
def same_group_outcomes(tmp_path_factory):
    return run_ranks(_same_group_rows, 2, str(tmp_path_factory.mktemp("ranks")), timeout=120,
                     collective_timeout=5)


@pytest.mark.parametrize("name, expected, says", [(r[0], r[2], r[3]) for r in SAME_GROUP],
                         ids=[r[0] for r in SAME_GROUP])
def test_bad_call_across_ranks_errors_on_every_rank(name, expected, says, same_group_outcomes):
    for rank, outcomes in enumerate(same_group_outcomes):
        exc, msg = outcomes[name]
        assert exc == expected, f"rank {rank}: expected {expected}, got {exc}: {msg}"
        assert re.search(says, msg, re.S), f"rank {rank}: {msg!r} does not match {says!r}"


BREAKS_GROUP = [
    # (id, fn, {rank: (exception name, what the message must say)})
    ("sync() on one rank only, peer never comes", sync_on_one_rank_only,
     {0: ("SyncError", r"sync #1 failed on rank 0.*every rank must call step\(\)/sync\(\) alike"),
      1: (None, None)}),
    ("sync() on one rank, then both train", sync_on_one_rank_then_both_train,
     {0: ("SyncError", r"sync #3 failed on rank 0.*every rank must call step\(\)/sync\(\) alike"),
      1: (None, None)}),
    ("model moved on one rank only", model_moved_on_one_rank,
     {0: ("SyncError", r"sync #1 failed on rank 0"),
      1: ("ConfigError", r"moved after the optimizer was wrapped.*Move the model")}),
]


@pytest.mark.parametrize("fn, expect", [r[1:] for r in BREAKS_GROUP], ids=[r[0] for r in BREAKS_GROUP])
def test_unmatched_collective_errors_within_the_timeout(fn, expect, tmp_path):
    got = run_ranks(fn, 2, str(tmp_path), timeout=60, collective_timeout=3)
    for rank, (exc, says) in expect.items():
        name, msg = got[rank]
        assert name == exc, f"rank {rank}: expected {exc}, got {name}: {msg}"
        if says is not None:
            assert re.search(says, msg, re.S), f"rank {rank}: {msg!r} does not match {says!r}"
