"""Compressed streaming syncs (fragments/overlap_steps with wire="bf16"|"fp16"|"int8"): Streaming DiLoCo's recipe.

Real Gloo ranks (tests/dist_harness.py), each with a timeout. The consensus of every merge is checked
against a float64 formula written here, within the codec's rounding bound; ranks must hold identical
anchors after every merge and identical params after ``sync()``; a checkpoint taken with a fragment in
flight (after either phase) resumes bit for bit; a peer killed in flight leaves the survivor's weights
and residuals untouched; a NaN rank gets no vote.
"""
from __future__ import annotations

import io
import os
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import flodl_opt as flo
from dist_harness import run_ranks, survivor_verdict, sync_error_verdict


def _mlp(seed=0, width=40, layers=4):
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods)


def _params64(model):
    return [p.detach().double().clone().numpy() for p in model.parameters()]


def _flat(model):
    return np.concatenate([p.detach().double().reshape(-1).numpy() for p in model.parameters()])


def _train(model, opt, rank, steps, start=0, after=None, width=40):
    for t in range(start + 1, start + steps + 1):
        g = torch.Generator().manual_seed(1000 * rank + t)
        x = torch.randn(8, width, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if after is not None:
            after(t)


def _build(wire, outer, seed=0, ef=True, **kw):
    if outer == "diloco":  # no warm-up: the reference below is the plain Nesterov step
        outer = flo.DiLoCo(lr=0.8, momentum=0.5, warmup=0)
    model = _mlp(seed)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=8, fragments=2, overlap_steps=2, outer=outer,
                                wire=wire, error_feedback=ef, stall_warning_s=None, **kw)
    return model, inner, opt


def _merge_run(rank, world, wire, outer):
    """Per step: params after the inner step (pre) and after the wrapper (post), the anchors after merges."""
    model, inner, opt = _build(wire, outer, ef=True)
    pre, post, anchors, stats = {}, {}, {}, {}
    inner.register_step_post_hook(lambda o, a, k: pre.__setitem__(len(pre) + 1, _params64(model)))

    g = opt.flat_params[0]

    def tensors(flat):  # the flat buffer's slots, one array per param
        return [flat[o:o + int(np.prod(sh))].double().numpy().reshape(sh).copy() for o, sh in zip(g.offsets, g.shapes)]

    def after(t):
        post[t] = _params64(model)
        s = opt.last_sync
        if s is not None and s.sync not in stats:
            stats[s.sync] = (t, s.fragment, s.bytes, s.collectives)
            own = torch.cat([st.anchor for sts in opt.stream.wire.states for st in sts])
            anchors[t] = (tensors(opt.outer.anchor[0] if opt.outer.anchor else own),
                          tensors(opt.outer.momentum[0]) if opt.outer.momentum else None,
                          # error feedback, in the fragments' flat coordinates: this rank's residual and
                          # the owner residual of the section it owns
                          [[st.residual.double().numpy().copy() for st in sts] for sts in opt.stream.wire.states],
                          [[st.owner_residual.double().numpy().copy() for st in sts] for sts in opt.stream.wire.states])
    init = _params64(model)
    _train(model, opt, rank, 17, after=after)
    opt.sync()
    return {"init": init, "pre": pre, "post": post, "anchors": anchors, "stats": stats, "final": _flat(model),
            "offsets": g.offsets, "starts": [f.params[0].start for f in opt.stream.fragments],
            "frags": [f.tensors for f in opt.stream.fragments], "fp32_bytes": [f.bytes for f in opt.stream.fragments]}


# int8: every element is encoded twice (rank, owner), each off by at most half its block's scale.
_BOUND = {"int8": lambda x, world: (world + 1) * np.abs(x).max() / 254 * 1.01 + 1e-6,
          "bf16": lambda x, world: (world + 1) * np.abs(x).max() * 2.0 ** -8 * 1.01 + 1e-6}


@pytest.mark.parametrize("wire, outer", [("int8", "diloco"), ("bf16", None)])
def test_compressed_fragment_merges_match_float64_within_the_codec_bound(wire, outer):
    world = 3
    res = run_ranks(_merge_run, world, wire, outer, timeout=120)
    r0 = res[0]
    assert r0["frags"] == [4, 4]          # 8 tensors (4 Linear layers), 2 a fragment... of about equal bytes
    frag_of = [0] * 4 + [1] * 4
    anchor, mom = [t.copy() for t in r0["init"]], [np.zeros_like(t) for t in r0["init"]]
    lr, mu = 0.8, 0.5
    shapes = [t.shape for t in r0["init"]]

    def per_tensor(vec, q):  # a fragment-flat vector as arrays of the fragment's tensors
        out = {}
        for k in range(8):
            if frag_of[k] == q:
                o = r0["offsets"][k] - r0["starts"][q]
                out[k] = vec[o:o + int(np.prod(shapes[k]))].reshape(shapes[k])
        return out
    residual = {q: [per_tensor(np.zeros(10 ** 6), q)] * world for q in (0, 1)}   # before any merge
    owner = {q: per_tensor(np.zeros(10 ** 6), q) for q in (0, 1)}
    last, issue, checked, bias = {0: 0, 1: 0}, {}, 0, [0.0, 0.0]
    for t in range(1, 18):
        merged = issue.pop(t - 2, None)   # tau = 2
        if merged is not None:
            q, sent, steps = merged
            ks = [k for k in range(8) if frag_of[k] == q]
            # int8 blocks run across tensor boundaries: bound by the fragment's largest difference
            largest = max(np.abs(s[k] - anchor[k]).max() for s in sent for k in ks)
            for k in ks:   # x_i = m_i (S_i - A + e_i); C = A + sum_i x_i / M + the owner's residual
                diff = [s[k] - anchor[k] + residual[q][r][k] for r, s in enumerate(sent)]
                exact = anchor[k] + sum(steps[r] * diff[r] for r in range(world)) / sum(steps) + owner[q][k]
                bound = _BOUND[wire](np.array([largest]), world)
                delta = exact - anchor[k]
                if outer == "diloco":  # the outer step scales the consensus' error by lr (1 + mu)
                    d = anchor[k] - exact
                    exact = anchor[k] - lr * (d + mu * (mu * mom[k] + d))
                    bound *= lr * (1 + mu)
                    delta *= lr * (1 + mu)
                # G from each rank's merge W <- G + (W - S): the same on every rank, near the formula
                gs = [res[r]["post"][t][k] - res[r]["pre"][t][k] + sent[r][k] for r in range(world)]
                for g in gs[1:]:
                    np.testing.assert_allclose(g, gs[0], rtol=0, atol=1e-6)
                err = np.abs(gs[0] - exact).max()
                assert 0.0 < err <= bound, (t, k, err, bound)   # 0: a wire that rounds nothing?
                bias[0] += float(((gs[0] - exact) * delta).sum())
                bias[1] += float((delta * delta).sum())
                checked += 1
            for r in range(1, world):  # every rank holds the same anchor and momentum, bit for bit
                for a, b in zip(res[0]["anchors"][t][0], res[r]["anchors"][t][0]):
                    assert np.array_equal(a, b), (t, r)
            anchor = [a.copy() for a in res[0]["anchors"][t][0]]   # what the ranks hold now
            residual[q] = [per_tensor(res[r]["anchors"][t][2][q][0], q) for r in range(world)]
            owner[q] = per_tensor(np.concatenate([res[r]["anchors"][t][3][q][0] for r in range(world)]), q)
            for r in range(world):  # error feedback: a residual is kept, within half a quantization step
                e = np.abs(np.concatenate([v.ravel() for v in residual[q][r].values()]))
                assert 0.0 < e.max() <= _BOUND[wire](np.array([largest]), 0), (t, r, e.max())
            if res[0]["anchors"][t][1] is not None:
                mom = [m.copy() for m in res[0]["anchors"][t][1]]
        p = {0: 0, 4: 1}.get(t % 8)
        if p is not None:
            steps = t - last[p]
            last[p] = t
            issue[t] = (p, [res[r]["pre"][t] for r in range(world)], [steps] * world)
    assert checked >= 8
    # rounding to nearest is unbiased: the error does not follow the update (a wrong weight would)
    assert abs(bias[0] / bias[1]) < 2e-3, bias[0] / bias[1]
    for r in range(1, world):
        assert np.array_equal(res[0]["final"], res[r]["final"]), "sync() ends with identical ranks"
    # bytes: the params' payload is about 1/4 (int8) or 1/2 (bf16) of the float32 reduce
    t, frag, nbytes, collectives = res[0]["stats"][1]
    ratio = (nbytes - 7 * 8) / res[0]["fp32_bytes"][frag]
    assert ratio < (0.3 if wire == "int8" else 0.55), ratio
    assert collectives == 3  # the count, the all_to_all and the all_gather


def _resume_run(rank, world, cut):
    """Straight run vs a checkpoint taken at step ``cut`` (fragment in flight) and resumed in a new model."""
    model, _, opt = _build("int8", "diloco")
    _train(model, opt, rank, 22)
    straight = _flat(model)
    model, _, opt = _build("int8", "diloco")
    _train(model, opt, rank, cut)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    pending = opt.state_dict()["flodl_opt"]["stream"]["pending"]
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model, _, opt = _build("int8", "diloco", seed=7)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    _train(model, opt, rank, 22 - cut, start=cut)
    return {"straight": straight, "resumed": _flat(model), "phase": None if pending is None else pending["phase"]}


@pytest.mark.parametrize("cut, phase", [(12, 1), (13, 2)])
def test_resume_with_a_compressed_fragment_in_flight_is_bit_exact(cut, phase):
    res = run_ranks(_resume_run, 2, cut, timeout=120)
    for r in res:
        assert r["phase"] == phase, "the checkpoint should hold a fragment in flight in this phase"
        assert np.array_equal(r["straight"], r["resumed"])


def _peer_dies(rank, world, out):
    model, _, opt = _build("int8", None)
    _train(model, opt, rank, 3)
    if rank == 1:  # fragment 1 is issued at step 4: die in its all_gather (step 5)
        real = dist.all_gather_into_tensor

        def dying(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_gather_into_tensor = dying
        if hasattr(dist, "all_gather_single"):
            dist.all_gather_single = dying
        del real
    residual = [st.residual.clone() for sts in opt.stream.wire.states for st in sts]
    anchor = [st.anchor.clone() for sts in opt.stream.wire.states for st in sts]
    pre = {}
    opt.optimizer.register_step_post_hook(lambda o, a, k: pre.__setitem__(len(pre) + 4, _flat(model)))
    return sync_error_verdict(
        out, lambda: _train(model, opt, rank, 4, start=3),
        lambda exc: {"msg": str(exc), "at": len(pre) + 3, "equal": np.array_equal(_flat(model), pre[len(pre) + 3]),
                     "residual": all(torch.equal(a, st.residual) for a, st in
                                     zip(residual, [s for sts in opt.stream.wire.states for s in sts])),
                     "anchor": all(torch.equal(a, st.anchor) for a, st in
                                   zip(anchor, [s for sts in opt.stream.wire.states for s in sts])),
                     "since": list(opt.stream.since), "pending": opt.stream.pending})


def test_peer_killed_in_a_compressed_flight_leaves_weights_anchor_and_residuals(tmp_path):
    out = str(tmp_path / "rank0.pt")
    r = survivor_verdict(_peer_dies, out, timeout=90, collective_timeout=15)
    assert r["msg"].startswith("flodl_opt: sync #"), r["msg"]
    assert r["equal"], "nothing of the failed consensus may be written"
    assert r["residual"] and r["anchor"], "residuals and anchor are written only by a merge that succeeded"
    assert r["pending"] is None


def _nonfinite_run(rank, world):
    model, _, opt = _build("int8", "diloco")
    _train(model, opt, rank, 3)
    if rank == 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
    with pytest.warns(flo.NonFiniteWarning) if rank == 1 else _null():
        _train(model, opt, rank, 3, start=3)   # fragment 1 at step 4 (NaN: no vote), merged at 6
    opt.sync()
    return {"params": _flat(model)}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_nonfinite_rank_gets_no_vote_in_a_compressed_fragment():
    a, b = run_ranks(_nonfinite_run, 2, timeout=90)
    assert np.isfinite(a["params"]).all() and np.array_equal(a["params"], b["params"])


def test_world_of_one_compressed_streaming_is_the_float32_path():
    """Nothing is sent in a world of one: the same result as wire='fp32'."""
    out = {}
    for wire in ("fp32", "int8"):
        model, _, opt = _build(wire, "diloco", ef=wire != "fp32")
        _train(model, opt, 0, 20)
        out[wire] = _flat(model)
    assert np.array_equal(out["fp32"], out["int8"])


def _warmup_run(rank, world, wire):
    out = {}
    for name, kw in (("stream", {"fragments": 2, "overlap_steps": 1, "wire": wire}), ("blocking", {})):
        model = _mlp(0)
        opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model=model,
                                    sync_every=8, warmup_steps=3, outer=flo.DiLoCo(lr=0.8, momentum=0.5, warmup=0),
                                    stall_warning_s=None, **kw)
        seen = []
        _train(model, opt, rank, 6, after=lambda t: seen.append(_flat(model)))
        out[name] = {"seen": seen, "anchor_after": opt.outer.anchor[0].double().numpy().copy(),
                     "syncs": opt.sync_count}
        if name == "stream":
            model2 = _mlp(0)
            opt2 = flo.LocalSGDOptimizer(torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9), model=model2,
                                         sync_every=8, warmup_steps=3, outer=flo.DiLoCo(lr=0.8, momentum=0.5, warmup=0),
                                         stall_warning_s=None, **kw)
            _train(model2, opt2, rank, 3)
            out["anchor_at_3"] = (opt2.outer.anchor[0].double().numpy().copy(),
                                  opt2.flat_params[0].flat.double().numpy().copy())
    return out


@pytest.mark.parametrize("wire", ["fp32", "int8"])
def test_warmup_syncs_every_step_then_streams(wire):
    a, b = run_ranks(_warmup_run, 2, wire, timeout=120)
    for t in range(3):   # warm-up: every step a full plain average, as the blocking warm-up
        assert np.array_equal(a["stream"]["seen"][t], b["stream"]["seen"][t])
        np.testing.assert_allclose(a["stream"]["seen"][t], a["blocking"]["seen"][t], rtol=0,
                                   atol=1e-6 if wire == "fp32" else 1e-3)
    assert not np.array_equal(a["stream"]["seen"][4], b["stream"]["seen"][4]), "after warm-up: local steps"
    anchor, params = a["anchor_at_3"]
    assert np.array_equal(anchor, params), "the outer optimizer starts from the warm-up's consensus"
    # 2 fragment syncs per warm-up step; the schedule starts after warm-up (fragment 1 first at step 3 + 4)
    assert a["stream"]["syncs"] == 3 * 2
