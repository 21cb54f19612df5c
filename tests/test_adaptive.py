"""sync_every="auto" (flodl_opt/hooks/adaptive.py) on real Gloo ranks.

The ranks get deliberately different data, so their local divergence readouts differ; the period
each rank picks must still be the same, and equal to the rule computed here in float64 from every
rank's readout (gathered test-side). Also: bounds, exact resume mid-period, every outer optimizer
with warm-up and ``join()``, the DDP drop-in, the config checks, and an int ``sync_every`` that
stays what it was.
"""
import copy
import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flodl_opt as flo
from flodl_opt.hooks.adaptive import AdaptiveSync, CohortDrift
from dist_harness import gather_object, run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3))


def _batch(rank, i):
    g = torch.Generator().manual_seed(7919 * rank + i)
    # Ranks see differently scaled data: their drift, hence their readouts, differ.
    return torch.randn(8, 6, generator=g) * (1 + 2 * rank), torch.randn(8, 3, generator=g)


def _step(model, opt, rank, i):
    x, y = _batch(rank, i)
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    opt.step()


def _reference_next(k, divs, steps, lo_k, hi_k, target, max_change):
    """The rule, written independently: RMS divergence and mean steps over the reporting ranks."""
    rep = [(d, n) for d, n in zip(divs, steps) if n > 0 and d is not None]
    if not rep:
        return k
    d = math.sqrt(sum(x * x for x, _ in rep) / len(rep))
    n = sum(m for _, m in rep) / len(rep)
    if d == 0:
        return k
    want = n * target / d
    lo = max(lo_k, math.ceil(k / max_change))
    hi = min(hi_k, math.floor(k * max_change))
    return min(hi, max(lo, math.floor(want + 0.5)))


# ---------------------------------------------------------------- the rule itself (no ranks)
def test_rule_matches_reference_and_respects_bounds():
    g = torch.Generator().manual_seed(3)
    for min_k, max_k, change in ((1, 64, 2.0), (3, 40, 1.5), (8, 8, 3.0)):
        ctl = AdaptiveSync(min_every=min_k, max_every=max_k, target=0.05, max_change=change,
                           initial=min(max(16, min_k), max_k))
        k = ctl.every
        for _ in range(200):
            n = int(torch.randint(0, 70, (1,), generator=g))
            d = float(torch.rand(1, generator=g)) ** 3 * 0.3  # includes tiny and zero-ish values
            drift = CohortDrift(1 if n > 0 else 0, d, float(n))
            want = _reference_next(k, [d], [n], min_k, max_k, 0.05, change)
            k = ctl.next_period(drift)
            assert k == want and min_k <= k <= max_k
    ctl = AdaptiveSync(min_every=2, max_every=256)
    assert ctl.next_period(CohortDrift(2, 0.0, 16.0)) == 16  # identical ranks: no evidence, keep K
    assert ctl.next_period(CohortDrift(0, 0.0, 0.0)) == 16   # nobody reported: keep K
    assert ctl.next_period(CohortDrift(2, 0.01, 16.0)) == 32  # 16 * 0.02 / 0.01, at most doubled
    assert ctl.state_dict() == {"every": 32, "decisions": 1}


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_every=0), "min_every must be an int >= 1"),
    (dict(min_every=2.0), "min_every must be an int >= 1"),
    (dict(max_every=0), "max_every must be an int >= 1"),
    (dict(min_every=32, max_every=8), r"max_every \(8\) must be >= min_every \(32\)"),
    (dict(target=0), "target is a relative divergence"),
    (dict(target=1.5), "target is a relative divergence"),
    (dict(target=float("nan")), "target is a relative divergence"),
    (dict(target="0.1"), "target is a relative divergence"),
    (dict(max_change=1.0), "max_change must be a number > 1"),
    (dict(initial=300), r"initial \(300\) must lie in \[min_every, max_every\]"),
])
def test_bad_adaptive_arguments_say_what_to_change(kwargs, match):
    with pytest.raises(flo.ConfigError, match=match):
        flo.AdaptiveSync(**kwargs)


@pytest.mark.parametrize("value", ["fast", "AUTO", 0, -3, 2.5, True, None, [4]])
def test_sync_every_other_than_int_auto_or_adaptive_is_rejected(value):
    flo.init()
    model = _model()
    with pytest.raises(flo.ConfigError, match="sync_every must be an int >= 1 .*'auto'.*AdaptiveSync"):
        flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                              sync_every=value)


def test_auto_needs_the_presync_copy():
    flo.init()
    model = _model()
    with pytest.raises(flo.ConfigError, match="drop keep_presync=False"):
        flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                              sync_every="auto", keep_presync=False)


def test_checkpoint_config_covers_the_controller():
    flo.init()

    def build(every):
        model = _model()
        return flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                     sync_every=every)

    sd = build(AdaptiveSync(target=0.05)).state_dict()
    assert sd["flodl_opt"]["adaptive"] == {"every": 16, "decisions": 0}
    assert "adaptive" not in build(16).state_dict()["flodl_opt"]
    for other in (16, "auto", AdaptiveSync(target=0.05, max_every=64)):
        with pytest.raises(flo.ConfigError, match="sync_every"):
            build(other).load_state_dict(sd)
    opt = build(AdaptiveSync(target=0.05))
    opt.load_state_dict(sd)
    build(16).load_state_dict(sd, strict=False)  # a deliberate change to a fixed K


# ---------------------------------------------------------------- ranks agree, bounds hold
def _run_auto(rank, ctl, steps, outer=None, warmup=0):
    """Train; per sync record this rank's readout and the K it picked, and the params."""
    model = _model()
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-2), model=model,
                                sync_every=ctl, outer=outer, warmup_steps=warmup)
    seen, log = None, []
    for i in range(steps):
        _step(model, opt, rank, i)
        s = opt.last_sync
        if s is not None and s is not seen:
            seen = s
            log.append({"sync": s.sync, "steps": s.steps, "div": s.divergence, "k": s.next_every,
                        "every": opt.sync_every, "cohort": s.cohort_divergence,
                        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])})
    return log


def rank_agree(rank, world):
    out = {}
    cases = {"mid": AdaptiveSync(min_every=1, max_every=12, target=0.02, initial=4),
             "low": AdaptiveSync(min_every=2, max_every=12, target=1e-6, initial=4),
             "high": AdaptiveSync(min_every=1, max_every=9, target=0.9, initial=4)}
    for name, ctl in cases.items():
        log = _run_auto(rank, ctl, 60)
        everyone = gather_object([{k: v for k, v in e.items() if k != "params"} for e in log])
        params = gather_object([e["params"] for e in log])
        for r in range(world):
            assert [e["k"] for e in everyone[r]] == [e["k"] for e in log]
            for a, b in zip(params[r], params[0]):
                assert torch.equal(a, b)  # the cohort synced at the same steps: identical params
        out[name] = everyone
    return out


def test_ranks_with_different_readouts_agree_on_k_and_follow_the_rule():
    out = run_ranks(rank_agree, 3, timeout=90)[0]
    bounds = {"mid": (1, 12, 0.02), "low": (2, 12, 1e-6), "high": (1, 9, 0.9)}
    for name, everyone in out.items():
        lo_k, hi_k, target = bounds[name]
        syncs = list(zip(*everyone))  # per sync: every rank's record
        assert len(syncs) >= 5
        k = 4
        for recs in syncs:
            divs = [e["div"] for e in recs]
            # the readouts really differ from rank to rank (else agreement would be trivial)
            assert len({round(d, 12) for d in divs}) == len(divs), divs
            want = _reference_next(k, divs, [e["steps"] for e in recs], lo_k, hi_k, target, 2.0)
            assert all(e["k"] == want == e["every"] for e in recs), (name, recs[0]["sync"], want)
            rms = math.sqrt(sum(d * d for d in divs) / len(divs))
            assert all(e["cohort"] == pytest.approx(rms, rel=1e-12) for e in recs)
            assert lo_k <= want <= hi_k
            k = want
        # the steps between syncs are the K chosen at the previous sync
        for prev, cur in zip(syncs, syncs[1:]):
            assert cur[0]["steps"] == prev[0]["k"]
    ks = {name: [recs[0]["k"] for recs in zip(*ev)] for name, ev in out.items()}
    assert ks["low"][-1] == 2 and ks["high"][-1] == 9  # both bounds are reached and held
    assert len(set(ks["mid"])) > 1                       # and the middle case does adapt


# ---------------------------------------------------------------- exact resume
def _resume(rank, total, cut, outer):
    def build():
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=2e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0 / (1 + 0.05 * s))
        opt = flo.LocalSGDOptimizer(inner, model=model, outer=outer, lr_scheduler=sched,
                                    sync_every=AdaptiveSync(min_every=1, max_every=10,
                                                            target=0.01, initial=3))
        return model, opt

    return _train_with_cut(build, rank, total, cut, lambda opt: opt.sync_every)


def _train_with_cut(build, rank, total, cut, probe):
    """Train ``total`` steps; at step ``cut`` (if any) save, rebuild and load, then go on.
    Returns the final model state, flodl_opt's state and ``probe(opt)`` after every step."""
    model, opt = build()
    seen = []
    for i in range(total):
        if cut and i == cut:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            model, opt = build()
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        _step(model, opt, rank, i)
        seen.append(probe(opt))
    return ([t.detach().clone() for t in model.state_dict().values()],
            opt.state_dict()["flodl_opt"], seen)


def rank_exact_resume(rank, world):
    cuts = []
    for outer in ("avg", "diloco"):
        ref, ref_state, ref_ks = _resume(rank, 40, None, outer)
        assert len(set(ref_ks)) > 1  # K changed during the run: the resume has state to carry
        # a cut where K was just changed and one mid-period
        for cut in (next(i for i in range(1, 40) if ref_ks[i] != ref_ks[i - 1]) + 1, 23):
            got, state, ks = _resume(rank, 40, cut, outer)
            assert ks[cut:] == ref_ks[cut:]
            assert state["counters"] == ref_state["counters"]
            assert state["adaptive"] == ref_state["adaptive"]
            for a, b in zip(ref, got):
                assert torch.equal(a, b), f"resume at {cut} with outer={outer} is not exact"
            cuts.append(cut)
    return cuts


def test_exact_resume_mid_run_with_auto():
    run_ranks(rank_exact_resume, 2, timeout=90)


# ---------------------------------------------------------------- outers, warm-up, join, DDP
def rank_outers_join(rank, world):
    out = {}
    for outer in ("avg", "diloco", "slowmo", "easgd"):
        model = _model()
        opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                                    outer=outer, warmup_steps=3,
                                    sync_every=AdaptiveSync(min_every=1, max_every=6, target=0.01,
                                                            initial=2))
        ks = []
        with opt.join():
            for i in range(30 if rank == 0 else 11):  # uneven data: rank 1 runs out first
                _step(model, opt, rank, i)
                if opt.steps_since_sync == 0:
                    ks.append((opt.sync_count, opt.sync_every))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[outer] = {"ks": gather_object(ks), "k_end": gather_object(opt.sync_every),
                      "params": gather_object(flat), "syncs": gather_object(opt.sync_count)}
    # the DDP drop-in: gradient all-reduce in warm-up, local afterwards, K chosen alike
    net = _model()
    model = DDP(net)
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                                warmup_steps=2, sync_every=AdaptiveSync(min_every=1, max_every=8,
                                                                        initial=4, target=0.01))
    ks = []
    for i in range(40):
        x, y = _batch(rank, i)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        if opt.steps_since_sync == 0:
            ks.append((opt.local_steps, opt.sync_every))
    opt.sync()
    out["ddp"] = {"ks": gather_object(ks),
                  "params": gather_object(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))}
    return out


def test_every_outer_with_warmup_join_and_ddp():
    res = run_ranks(rank_outers_join, 2, timeout=90)[0]
    for outer in ("avg", "diloco", "slowmo", "easgd"):
        r = res[outer]
        assert r["k_end"][0] == r["k_end"][1] and r["syncs"][0] == r["syncs"][1]
        # rank 1 stopped early; while both trained, they synced at the same steps with the same K
        common = min(len(r["ks"][0]), len(r["ks"][1]))
        assert common >= 4 and r["ks"][0][:common] == r["ks"][1][:common]
        assert all(1 <= k <= 6 for _, k in r["ks"][0])
        if outer != "easgd":  # EASGD ranks keep part of their drift by design
            assert torch.equal(r["params"][0], r["params"][1]), outer
    d = res["ddp"]
    assert d["ks"][0] == d["ks"][1] and len(d["ks"][0]) >= 3
    # warm-up syncs every step, and DDP keeps the ranks identical there: no evidence, K kept
    assert d["ks"][0][:2] == [(1, 4), (2, 4)] and len({k for _, k in d["ks"][0]}) > 1
    assert torch.equal(d["params"][0], d["params"][1])


# ---------------------------------------------------------------- config across ranks, int unchanged
def rank_mismatch(rank, world, specs):
    model = _model()
    try:
        flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                              sync_every=specs[rank])
    except flo.ConfigError as e:
        return str(e)


@pytest.mark.parametrize("specs", [("auto", 16), ("auto", AdaptiveSync(target=0.05))],
                         ids=["auto-vs-int", "different-targets"])
def test_auto_config_must_match_on_every_rank(specs):
    for m in run_ranks(rank_mismatch, 2, specs, timeout=30):
        assert m is not None and "sync_every" in m and "differ from rank 0" in m


def rank_int_unchanged(rank, world):
    res = {}
    for name, every in (("int", 4), ("pinned", AdaptiveSync(min_every=4, max_every=4, initial=4))):
        model = _model()
        opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model,
                                    sync_every=every)
        stats = []
        for i in range(12):
            _step(model, opt, rank, i)
            if opt.steps_since_sync == 0:
                stats.append(opt.last_sync)
        res[name] = ([t.detach().clone() for t in model.state_dict().values()], stats)
    return res


def test_int_sync_every_keeps_its_collectives_and_results():
    res = run_ranks(rank_int_unchanged, 2, timeout=60)[0]
    (p_int, s_int), (p_pin, s_pin) = res["int"], res["pinned"]
    # A controller pinned to K=4 syncs at the same steps with the same numbers: the adaptive
    # path adds a decision, never a change to the sync itself.
    assert [s.sync for s in s_int] == [s.sync for s in s_pin] == [1, 2, 3]
    for a, b in zip(p_int, p_pin):
        assert torch.equal(a, b)
    for a, b in zip(s_int, s_pin):
        assert a.divergence == b.divergence and a.next_every == b.next_every == 4
        # an int K issues no extra collective; "auto" one tiny 24-byte SUM per sync
        assert b.collectives == a.collectives + 1 and b.bytes == a.bytes + 24
        assert a.cohort_divergence is None and b.cohort_divergence is not None


# ---------------------------------------------------------------- the char-LM demo
def test_charlm_demo_accepts_auto_and_reports_k(tmp_path):
    from test_examples import TINY, run_example
    log = tmp_path / "curve.json"
    out = run_example(["--nproc", "2", "--steps", "16", "--sync-every", "auto", "--auto-target", "0.01",
                       "--eval-every", "8", "--print-every", "8", *TINY, "--log", str(log)])
    assert "| K " in out
    res = __import__("json").loads(log.read_text())
    ks = [p["sync_every"] for p in res["curve"][1:] if p["syncs"]]
    assert ks and all(isinstance(k, int) and 2 <= k <= 256 for k in ks)
    a, b = res["final"]["param_checksums"]
    assert a == b  # ends on the consensus


# ---------------------------------------------------------------- with fragments and overlap
def _quantize(k, parts, tau, lo_k, hi_k):
    """Independent of the library: the nearest multiple of P with tau < K/P, inside the bounds."""
    lo = max(parts * (tau + 1), parts * math.ceil(lo_k / parts))
    hi = parts * (hi_k // parts)
    return min(hi, max(lo, parts * math.floor(k / parts + 0.5)))


def _stream_opt(model, ctl, outer="avg"):
    return flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-2), model=model,
                                 sync_every=ctl, outer=outer, fragments=2, overlap_steps=1)


def _logged(opt):
    """Every fragment sync's stats, in order (a test probe on the optimizer's record step)."""
    log, record = [], opt._record

    def probe(done):
        log.extend((opt.local_steps, s) for s in done)
        record(done)
    opt._record = probe
    return log


def rank_stream_agree(rank, world):
    model = _model()
    opt = _stream_opt(model, AdaptiveSync(min_every=3, max_every=24, target=0.1, initial=5))
    assert opt.sync_every == 6  # initial 5 -> the nearest period the schedule runs (P=2: halves up)
    log = _logged(opt)
    for i in range(90):
        _step(model, opt, rank, i)
    scheduled = len(log)
    opt.sync()
    rows = [{"at": at, "fragment": s.fragment, "div": s.divergence, "post": s.post_norm,
             "steps": s.steps, "k": s.next_every, "skipped": s.skipped, "cohort": s.cohort_divergence}
            for at, s in log[:scheduled]]  # all but the closing opt.sync()
    return {"rows": gather_object(rows),
            "params": gather_object(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))}


def test_auto_with_fragments_and_overlap_agrees_on_every_rank_and_follows_the_rule():
    res = run_ranks(rank_stream_agree, 3, timeout=120)[0]
    rows = res["rows"]
    assert all(len(r) == len(rows[0]) for r in rows)
    for r in range(3):
        assert torch.equal(res["params"][r], res["params"][0])
        assert [(x["at"], x["fragment"], x["k"]) for x in rows[r]] == \
            [(x["at"], x["fragment"], x["k"]) for x in rows[0]]  # same syncs, same K, every rank
    k, readouts, last_close, decided = 6, [[] for _ in range(3)], None, []
    for i, recs in enumerate(zip(*rows)):
        for r, x in enumerate(recs):
            if not x["skipped"] and x["div"] is not None:
                readouts[r].append(((x["div"] * x["post"]) ** 2, x["post"] ** 2, x["steps"]))
        if recs[0]["fragment"] != 0:
            assert all(x["k"] == k for x in recs)
            continue
        # fragment 0 closes a round: its merge comes K (of that round) steps after the previous one
        if last_close is not None:
            assert recs[0]["at"] - last_close == k
        last_close = recs[0]["at"]
        divs = [math.sqrt(sum(a for a, _, _ in rd) / sum(b for _, b, _ in rd)) for rd in readouts]
        steps = [sum(c for _, _, c in rd) / len(rd) for rd in readouts]
        assert len({round(d, 12) for d in divs}) == 3, divs  # the ranks' readouts really differ
        want = _quantize(_reference_next(k, divs, steps, 3, 24, 0.1, 2.0), 2, 1, 3, 24)
        assert all(x["k"] == want for x in recs), (i, want, [x["k"] for x in recs])
        rms = math.sqrt(sum(d * d for d in divs) / 3)
        assert all(x["cohort"] == pytest.approx(rms, rel=1e-12) for x in recs)
        k, readouts = want, [[] for _ in range(3)]
        decided.append(want)
    assert len(decided) >= 4 and len(set(decided)) > 1  # several rounds, and K did move
    assert all(4 <= d <= 24 and d % 2 == 0 for d in decided)


def _stream_resume(rank, total, cut, outer):
    def build():
        model = _model()
        return model, _stream_opt(model, AdaptiveSync(min_every=2, max_every=16, target=0.1, initial=4),
                                  outer)
    return _train_with_cut(build, rank, total, cut,
                           lambda opt: (opt.sync_every, opt.stream.pending is not None))


def rank_stream_resume(rank, world):
    for outer in ("avg", "diloco"):
        ref, ref_state, ref_ks = _stream_resume(rank, 48, None, outer)
        assert len({k for k, _ in ref_ks}) > 1
        changed = next(i for i in range(1, 48) if ref_ks[i][0] != ref_ks[i - 1][0]) + 1
        in_flight = next(i for i in range(changed + 1, 48) if ref_ks[i - 1][1])  # saved mid-flight
        for cut in (changed, in_flight, 29):
            got, state, ks = _stream_resume(rank, 48, cut, outer)
            assert ks[cut:] == ref_ks[cut:]
            assert state["adaptive"] == ref_state["adaptive"] and state["counters"] == ref_state["counters"]
            assert state["stream"]["round"] == ref_state["stream"]["round"]
            for a, b in zip(ref, got):
                assert torch.equal(a, b), f"resume at {cut} with outer={outer} is not exact"
    return True


def test_exact_resume_with_auto_fragments_and_a_fragment_in_flight():
    run_ranks(rank_stream_resume, 2, timeout=120)


def rank_stream_join(rank, world):
    model = _model()
    opt = _stream_opt(model, AdaptiveSync(min_every=2, max_every=12, target=0.1, initial=4), "diloco")
    ks = []
    with opt.join():
        for i in range(50 if rank == 0 else 17):  # rank 1 runs out of data first
            _step(model, opt, rank, i)
            ks.append(opt.sync_every)
    return {"ks": gather_object(ks), "params": gather_object(
        torch.cat([p.detach().reshape(-1) for p in model.parameters()]))}


def test_auto_with_fragments_under_join_ends_identical():
    res = run_ranks(rank_stream_join, 2, timeout=120)[0]
    assert res["ks"][0][:17] == res["ks"][1]
    assert torch.equal(res["params"][0], res["params"][1])
