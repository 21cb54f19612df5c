"""Streaming syncs (fragments=P, overlap_steps=tau): schedule, merge, resume, failure, defaults.

Every multi-rank case runs on real Gloo ranks (tests/dist_harness.py) with a timeout. Most cases
share one 2-rank run (the ``streamed`` fixture) so the processes start once. Rank functions return
numpy arrays, never tensors.
"""
from __future__ import annotations

import io
import os
import re
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import flodl_opt as flo
from dist_harness import load_base, run_with_base, survivor_verdict, sync_error_verdict

# The commit this mode was built on: its blocking sync is what the defaults must reproduce bit for bit.
BASE_COMMIT = "1e44889"


def _flat(model: nn.Module) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1).double() for t in
                      list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]]).numpy()


def _params64(model: nn.Module) -> list:
    return [p.detach().double().clone().numpy() for p in model.parameters()]


def _batch(rank: int, t: int, n_in: int):
    g = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(8, n_in, generator=g)


def _train(model, opt, rank, steps, start=0, n_in=6, after=None):
    for t in range(start + 1, start + steps + 1):
        x = _batch(rank, t, n_in)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if after is not None:
            after(t)


def _mlp(seed=0, width=6, layers=4, bn=False):
    torch.manual_seed(seed)
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if bn and i == 1:
            mods.append(nn.BatchNorm1d(width))
        mods.append(nn.Tanh())
    return nn.Sequential(*mods)


# ------------------------------------------------------------------ scenarios (one 2-rank run)
def _schedule(rank, world):
    """Which fragment is issued / merged at which step, and the fragments themselves."""
    sizes = [(6, 24), (24, 24), (24, 24), (24, 24), (24, 3)]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(a, b) for a, b in sizes])
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model=model, sync_every=6,
                                fragments=3, overlap_steps=1, stall_warning_s=None)
    events, seen = [], [0]

    def after(t):  # (step, fragment in flight, fragment merged in this step, its bytes)
        pending = opt.stream.pending
        merged = opt.last_sync if opt.sync_count != seen[0] else None
        seen[0] = opt.sync_count
        events.append((t, None if pending is None else pending.fragment,
                       None if merged is None else merged.fragment, None if merged is None else merged.bytes))
    _train(model, opt, rank, 20, after=after)
    frags = [([(s.index, s.start, s.end) for s in f.params], f.bytes) for f in opt.stream.fragments]
    offsets = [(g.offsets, g.numel) for g in opt.flat_params]
    return {"events": events, "frags": frags, "offsets": offsets,
            "sizes": [p.numel() for p in model.parameters()]}


def _merge_reference_run(rank, world):
    """Records what the float64 reference of the delayed-update merge needs (test computes it)."""
    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=4, fragments=2, overlap_steps=1,
                                outer=flo.DiLoCo(lr=0.7, momentum=0.9, nesterov=True, warmup=0), stall_warning_s=None)
    init = _params64(model)
    pre, post = {}, {}
    step = [0]

    def hook(optimizer, args, kwargs):  # after the inner step, before the wrapper counts / merges
        step[0] += 1
        pre[step[0]] = _params64(model)
    inner.register_step_post_hook(hook)
    _train(model, opt, rank, 9, after=lambda t: post.__setitem__(t, _params64(model)))
    return {"init": init, "pre": pre, "post": post,
            "frag_tensors": [f.tensors for f in opt.stream.fragments]}


def _resume_run(rank, world):
    """Save with a fragment in flight, resume in a new model/optimizer, compare bit for bit."""
    def build(seed):
        model = _mlp(seed=seed, bn=True)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0 / (1 + 0.05 * s))
        opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=8, fragments=2, overlap_steps=2,
                                    outer="diloco", lr_scheduler=sched, stall_warning_s=None)
        return model, opt
    model, opt = build(0)
    _train(model, opt, rank, 22)
    straight = _flat(model)

    model, opt = build(0)
    _train(model, opt, rank, 13)   # fragment 1 issued at step 12, merged at step 14
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    in_flight = opt.state_dict()["flodl_opt"]["stream"]["pending"] is not None
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model, opt = build(123)        # other initial weights: everything must come from the checkpoint
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    _train(model, opt, rank, 9, start=13)
    resumed = _flat(model)
    opt.sync()
    return {"straight": straight, "resumed": resumed, "in_flight": in_flight,
            "after_sync": _flat(model), "finite": bool(np.isfinite(_flat(model)).all())}


def _join_run(rank, world):
    """Uneven data under join(): every rank ends on the same consensus."""
    model = _mlp(bn=True)
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model, sync_every=6,
                                fragments=3, overlap_steps=1, outer="diloco", stall_warning_s=None)
    with opt.join():
        _train(model, opt, rank, [17, 9][rank])
    return {"params": _flat(model), "local_steps": opt.local_steps}


def _nonfinite_run(rank, world):
    """A rank that goes NaN gets no vote; the cohort's recovery sync leaves everyone finite, equal."""
    model = _mlp()
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model=model,
                                sync_every=4, fragments=2, overlap_steps=1, stall_warning_s=None)
    _train(model, opt, rank, 3)
    if rank == 1:
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(model, opt, rank, 2, start=3)   # fragment 0 issued at 4 (NaN on rank 1), merged at 5
    flags = opt.last_sync.nonfinite
    return {"params": _flat(model), "nonfinite_seen": flags, "syncs": opt.sync_count}


def _ddp_run(rank, world):
    """DDP drop-in: the wrapped model trains locally between fragment syncs; sync() equalizes."""
    from torch.nn.parallel import DistributedDataParallel
    net = _mlp()
    model = DistributedDataParallel(net)
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model, sync_every=4,
                                fragments=2, overlap_steps=1, stall_warning_s=None)
    pre_sync = []
    _train(model, opt, rank, 7)
    pre_sync = _flat(net)
    opt.sync()
    return {"pre": pre_sync, "post": _flat(net)}


def _defaults_run(rank, world, base_dir):
    """Defaults, explicit fragments=1/overlap_steps=0 and the base commit's blocking sync."""
    out = {}
    variants = {"default": {}, "explicit": {"fragments": 1, "overlap_steps": 0}}
    if base_dir is not None:
        variants["base"] = None
    for name, kwargs in variants.items():
        lib = load_base(base_dir) if kwargs is None else flo
        for outer in ("avg", "diloco"):
            model = _mlp(bn=True)
            inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
            # warmup=0: the base commit's DiLoCo had no warm-up
            spec = None if outer == "avg" else lib.DiLoCo(
                lr=0.7, momentum=0.9, nesterov=True, **({} if kwargs is None else {"warmup": 0}))
            opt = lib.LocalSGDOptimizer(inner, model=model, sync_every=3, outer=spec, max_grad_norm=1.0,
                                        stall_warning_s=None, **(kwargs or {}))
            if kwargs is not None:
                out.setdefault("stream", []).append(opt.stream is None)
            _train(model, opt, rank, 10)
            opt.sync()
            out[(name, outer)] = _flat(model)
    return out


def _all_scenarios(rank, world, base_dir):
    return {"schedule": _schedule(rank, world), "merge": _merge_reference_run(rank, world),
            "resume": _resume_run(rank, world), "join": _join_run(rank, world),
            "nonfinite": _nonfinite_run(rank, world), "ddp": _ddp_run(rank, world),
            "defaults": _defaults_run(rank, world, base_dir)}


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    return run_with_base(_all_scenarios, 2, tmp_path_factory.mktemp("base"), BASE_COMMIT)


# ------------------------------------------------------------------ tests
def test_schedule_and_fragments_identical_on_every_rank_with_the_documented_offsets(streamed):
    res, _ = streamed
    a, b = res[0]["schedule"], res[1]["schedule"]
    assert a["events"] == b["events"] and a["frags"] == b["frags"]
    # K=6, P=3, tau=1: fragment p is issued at t % 6 == 2p and merged at the next step.
    for t, in_flight, merged, _ in a["events"]:
        issued = (t % 6) // 2 if t % 2 == 0 else None
        assert in_flight == issued, (t, in_flight)
        prev = t - 1
        expect_merge = (prev % 6) // 2 if prev >= 1 and prev % 2 == 0 else None
        assert merged == expect_merge, (t, merged)
    # Fragments: whole tensors, in order, covering every param once.
    (offsets, numel), = a["offsets"]
    cuts = [(s, e) for slices, _ in a["frags"] for _, s, e in slices]
    assert cuts[0][0] == 0 and cuts[-1][1] == numel
    assert all(e == s2 for (_, e), (s2, _) in zip(cuts, cuts[1:]))
    assert all(s in offsets for s, _ in cuts)
    # ~1/P of the bytes each; a sync reports its fragment's bytes + the 7-double count.
    total = sum(nb for _, nb in a["frags"])
    assert total == numel * 4
    assert max(nb for _, nb in a["frags"]) <= 0.4 * total, a["frags"]
    reported = {m: nb for _, _, m, nb in a["events"] if m is not None}
    assert reported == {p: a["frags"][p][1] + 56 for p in range(3)}


def test_delayed_update_merge_matches_float64_reference(streamed):
    res, _ = streamed
    r0, r1 = res[0]["merge"], res[1]["merge"]
    assert r0["frag_tensors"] == [4, 4]
    frag_of = [0] * 4 + [1] * 4         # 4 Linear layers of equal padded size: 2 layers a fragment
    lr, mu = 0.7, 0.9
    anchor = [t.copy() for t in r0["init"]]
    assert all(np.array_equal(x, y) for x, y in zip(r0["init"], r1["init"]))  # broadcast start
    mom = [np.zeros_like(t) for t in anchor]
    last = {0: 0, 1: 0}
    issue = {}
    for t in range(1, 10):
        p = {0: 0, 2: 1}.get(t % 4)
        merged = issue.pop(t - 1, None)  # tau = 1
        if merged is not None:
            q, sent, m = merged
            for k in [k for k in range(8) if frag_of[k] == q]:
                c = (m[0] * sent[0][k] + m[1] * sent[1][k]) / (m[0] + m[1])
                d = anchor[k] - c
                mom[k] = mu * mom[k] + d
                g = anchor[k] - lr * (d + mu * mom[k])
                anchor[k] = g
                for r, rec in enumerate((r0, r1)):
                    want = g + (rec["pre"][t][k] - sent[r][k])
                    np.testing.assert_allclose(rec["post"][t][k], want, rtol=0, atol=2e-6,
                                               err_msg=f"step {t} tensor {k} rank {r}")
        for r, rec in enumerate((r0, r1)):   # tensors not merged at this step are untouched
            for k in range(8):
                if merged is None or frag_of[k] != merged[0]:
                    assert np.array_equal(rec["post"][t][k], rec["pre"][t][k]), (t, k, r)
        if p is not None:
            steps = t - last[p]
            last[p] = t
            issue[t] = (p, [r0["pre"][t], r1["pre"][t]], [steps, steps])
    # the delayed update kept each rank's own progress: ranks differ between syncs
    assert not np.array_equal(np.concatenate([x.ravel() for x in r0["post"][9]]),
                              np.concatenate([x.ravel() for x in r1["post"][9]]))


def test_resume_with_a_fragment_in_flight_is_bit_exact(streamed):
    res, _ = streamed
    for r in res:
        assert r["resume"]["in_flight"], "the checkpoint should have been taken mid-flight"
        assert np.array_equal(r["resume"]["straight"], r["resume"]["resumed"])
        assert r["resume"]["finite"]
    assert np.array_equal(res[0]["resume"]["after_sync"], res[1]["resume"]["after_sync"])


def test_join_with_uneven_data_ends_identical(streamed):
    res, _ = streamed
    assert [r["join"]["local_steps"] for r in res] == [17, 9]
    assert np.array_equal(res[0]["join"]["params"], res[1]["join"]["params"])
    assert np.isfinite(res[0]["join"]["params"]).all()


def test_nonfinite_rank_recovers_through_a_full_sync(streamed):
    res, _ = streamed
    a, b = res[0]["nonfinite"], res[1]["nonfinite"]
    assert np.isfinite(a["params"]).all() and np.isfinite(b["params"]).all()
    assert np.array_equal(a["params"], b["params"]), "the recovery sync leaves the ranks identical"
    assert a["syncs"] == b["syncs"] == 1 + 1 + 2  # frag 1 @2, frag 0 @4 (NaN), recovery of both


def test_ddp_drop_in_trains_locally_and_sync_equalizes(streamed):
    res, _ = streamed
    a, b = res[0]["ddp"], res[1]["ddp"]
    assert not np.array_equal(a["pre"], b["pre"]), "DDP must not have averaged every step"
    assert np.array_equal(a["post"], b["post"])


def test_defaults_are_bit_identical_to_the_blocking_sync(streamed):
    res, base = streamed
    for r in res:
        d = r["defaults"]
        assert all(d["stream"]), "fragments=1, overlap_steps=0 must take the blocking path"
        for outer in ("avg", "diloco"):
            assert np.array_equal(d[("default", outer)], d[("explicit", outer)])
            if base is not None:
                assert np.array_equal(d[("default", outer)], d[("base", outer)]), outer
    if base is None:
        pytest.skip(f"git has no commit {BASE_COMMIT}: compared defaults with explicit values only")


# ------------------------------------------------------------------ a peer dies in flight
def _peer_dies_in_flight(rank, world, out):
    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=8, fragments=2, overlap_steps=2,
                                stall_warning_s=None)
    _train(model, opt, rank, 3)
    if rank == 1:  # take part in the count of fragment 1's sync (step 4), die before its data
        real, calls = dist.all_reduce, []

        def dying(tensor, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(tensor, *args, **kwargs)
        dist.all_reduce = dying
    pre = {}
    inner.register_step_post_hook(lambda o, a, k: pre.__setitem__(len(pre) + 4, _flat(model)))
    return sync_error_verdict(
        out, lambda: _train(model, opt, rank, 3, start=3),   # issue at 4, merge at 6
        lambda exc: {"msg": str(exc), "sync": exc.sync, "restored": exc.restored, "at": len(pre) + 3,
                     "equal": np.array_equal(_flat(model), pre[6]), "since": list(opt.stream.since),
                     "pending": opt.stream.pending, "syncs": opt.sync_count})


def test_peer_killed_with_a_fragment_in_flight_survivor_keeps_local_weights_and_raises(tmp_path):
    out = str(tmp_path / "rank0.pt")
    r = survivor_verdict(_peer_dies_in_flight, out, timeout=60, collective_timeout=15)
    assert r["msg"].startswith("flodl_opt: sync #1 failed on rank 0"), r["msg"]
    assert r["at"] == 6, "the failure surfaces at the merge, tau steps after the issue"
    assert r["restored"] and r["equal"], "nothing of the failed consensus may be written"
    assert r["pending"] is None and r["syncs"] == 0
    assert r["since"] == [6, 6], "the fragment keeps the steps it tried to send"


# ------------------------------------------------------------------ bad input (a world of one)
@pytest.mark.parametrize("kwargs, words", [
    ({"fragments": 3, "sync_every": 16}, "multiple of fragments"),
    ({"fragments": 4, "sync_every": 16, "overlap_steps": 4}, "< sync_every/fragments"),
    ({"overlap_steps": 16, "sync_every": 16}, "< sync_every/fragments"),
    ({"fragments": 0}, "fragments must be an int >= 1"),
    ({"fragments": True}, "fragments must be an int"),
    ({"overlap_steps": -1}, "overlap_steps must be an int >= 0"),
    ({"fragments": 2, "keep_presync": False}, "keep_presync"),
    ({"fragments": 2, "outer": "easgd"}, "'easgd' is not supported"),
    ({"overlap_steps": 1, "outer": flo.DiLoCo(reset_inner=True)}, "reset_inner=False"),
    ({"fragments": 16, "sync_every": 16}, "more than the 8 synced param tensors"),
    ({"fragments": 4, "overlap_steps": 2, "sync_every": flo.AdaptiveSync(max_every=8)},
     "at least 12 (overlap_steps < K/fragments), but max_every=8: raise max_every to >= 12"),
])
def test_unsupported_streaming_combinations_refuse_clearly(kwargs, words):
    model = _mlp()
    kw = {"sync_every": 16, **kwargs}
    with pytest.raises(flo.ConfigError, match=re.escape(words)):
        flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, **kw)


def test_torch_outer_refused_with_fragments():
    import functools
    model = _mlp()
    with pytest.raises(flo.ConfigError, match="not supported"):
        flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=4,
                              fragments=2, outer=functools.partial(torch.optim.SGD, lr=0.7))


def test_checkpoint_of_another_streaming_config_is_refused():
    model = _mlp()
    a = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=4,
                              fragments=2)
    sd = a.state_dict()
    model2 = _mlp()
    b = flo.LocalSGDOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1), model=model2, sync_every=4)
    with pytest.raises(flo.ConfigError, match="fragments"):
        b.load_state_dict(sd, strict=False)
