"""tools/cohort_sim.py, the convergence study's simulator: a stopped and resumed run equals an unbroken one,
and its ``localsgd-auto`` follows the library's rule within its bounds."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = os.path.join(ROOT, "tools", "cohort_sim.py")
TINY = ["--d-model", "16", "--heads", "2", "--layers", "1", "--context", "16", "--batch-size", "4",
        "--eval-batches", "2", "--corpus-mb", "0.2", "--steps", "60", "--eval-every", "20", "--seeds", "0,1",
        "--methods", "allreduce,localsgd-k8,localsgd-auto,diloco-h8,localsgd-k8-svc,localsgd-k4-avgmvc-me2", "--device", "cpu", "--threads", "1"]


def _sim(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    subprocess.run([sys.executable, SIM, *TINY, *extra, "--json", str(out)], check=True, timeout=240,
                   capture_output=True, text=True)
    return json.loads(out.read_text())


@pytest.mark.timeout(600)
def test_a_run_stopped_and_resumed_from_its_state_equals_an_unbroken_run(tmp_path):
    whole = _sim(tmp_path, "whole")
    state = tmp_path / "state.pt"
    first = _sim(tmp_path, "first", "--stop-after", "30", "--state", str(state))   # between two evaluations
    assert first["config"]["partial"] and state.exists()
    assert first["runs"][0]["curve"][-1]["step"] == 20
    rest = _sim(tmp_path, "rest", "--state", str(state))
    for a, b in zip(whole["runs"], rest["runs"]):
        assert [p["val_loss"] for p in a["curve"]] == [p["val_loss"] for p in b["curve"]], a["name"]
        assert (a["syncs"], a["bytes"], a["ks"]) == (b["syncs"], b["bytes"], b["ks"])
    auto = [r for r in whole["runs"] if r["name"] == "localsgd-auto"]
    for r in auto:   # the library's AdaptiveSync: K starts at 16, moves at most 2x per sync, in [2, 256]
        ks = [16] + [k for _, k in r["ks"]]
        assert all(2 <= k <= 256 for k in ks)
        assert all(b <= 2 * a and a <= 2 * b for a, b in zip(ks, ks[1:]))
        assert len(set(ks)) > 1
        steps = [s for s, _ in r["ks"]]
        assert all(s1 - s0 == k for (s0, k), s1 in zip(r["ks"], steps[1:]) if s1 != 60)


@pytest.mark.timeout(600)
def test_a_run_lr_multiplier_equals_the_run_at_that_lr(tmp_path):
    """``-lrx2`` is AdamW at twice the lr (decay and outer step included); ``-lrx1`` changes nothing."""
    methods = ["--methods", "allreduce,localsgd-k8,diloco-h8", "--seeds", "0"]
    base = _sim(tmp_path, "base", *methods, "--lr", "4e-3")
    same = _sim(tmp_path, "same", "--methods", "allreduce-lrx1,localsgd-k8-lrx1,diloco-h8-lrx1", "--seeds", "0",
                "--lr", "4e-3")
    twice = _sim(tmp_path, "twice", "--methods", "allreduce-lrx2,localsgd-k8-lrx2,diloco-h8-lrx2", "--seeds", "0",
                 "--lr", "2e-3")
    half = _sim(tmp_path, "half", *methods, "--lr", "2e-3")
    for a, b, c, d in zip(base["runs"], same["runs"], twice["runs"], half["runs"]):
        va, vb, vc, vd = ([p["val_loss"] for p in r["curve"]] for r in (a, b, c, d))
        assert va == vb, a["name"]                      # the multiplier at 1 is bit-identical
        assert vc == pytest.approx(va, rel=2e-4), a["name"]
        assert abs(vd[-1] - va[-1]) > 50 * abs(vc[-1] - va[-1]), a["name"]   # the lr matters far more
        assert c["lr_scale"] == 2.0 and d["lr_scale"] == 1.0


def _load_sim():
    from dist_harness import load_script
    return load_script("cohort_sim", SIM)


def test_each_method_suffix_sets_only_its_own_option():
    sim = _load_sim()
    base = sim.method_spec("localsgd-k16")
    for name, changed in [("localsgd-k16-clip0", {"clip": float("inf")}), ("localsgd-k16-clip2", {"clip": 2.0}),
                          ("localsgd-k16-wd0", {"wd": 0.0}), ("localsgd-k16-lrx1.41", {"lr_scale": 1.41}),
                          ("localsgd-k16-avgmvc", {"avg_m": "mvc"}),
                          ("localsgd-k16-avgm-clip0", {"avg_m": "m", "clip": float("inf")}),
                          ("localsgd-k16-svc", {"svc": True}), ("localsgd-k16-avgm-svc", {"avg_m": "m", "svc": True}),
                          ("localsgd-k16-avgmvc-me2", {"avg_m": "mvc", "m_every": 2}),
                          ("localsgd-k16-avgmvc-me2-mbf16", {"avg_m": "mvc", "m_every": 2, "mbf16": True}),
                          ("localsgd-k16-saw0.5", {"saw": 0.5}), ("localsgd-k16-saw0.9-avgmvc", {"saw": 0.9, "avg_m": "mvc"}),
                          ("localsgd-k16-pvc", {"pvc": True}), ("localsgd-k16-pvcm", {"pvc": True, "pvcm": True})]:
        spec = sim.method_spec(name)
        assert {k: v for k, v in spec.items() if k != "name" and base[k] != v} == changed, name
    with pytest.raises(SystemExit, match="-mbf16 narrows -avgmvc"):
        sim.method_spec("localsgd-k16-avgmv-mbf16")
    for bad in ("allreduce-saw0.5", "localsgd-auto-saw0.5", "localsgd-k16-saw1", "localsgd-k16-saw0",
                "diloco-h16-pvc", "localsgd-k16-avgmvc-pvc", "localsgd-k16-svc-pvcm", "allreduce-pvc"):
        with pytest.raises(SystemExit):
            sim.method_spec(bad)


def test_saw_lr_falls_through_each_window_and_averages_to_the_schedules_lr():
    sim = _load_sim()
    f = [sim.saw_factor(t, 16, 0.5) for t in range(16)]
    assert f[0] == pytest.approx(1.5) and f[-1] == pytest.approx(0.5)
    assert all(a > b for a, b in zip(f, f[1:]))
    assert sum(f) / 16 == pytest.approx(1.0, abs=1e-12)
    assert sim.saw_factor(0, 1, 0.5) == 1.0   # a window of one step (warm-up) keeps the lr


@pytest.mark.timeout(600)
def test_a_saw_run_is_the_plain_run_with_its_window_lr(tmp_path):
    """As A goes to 0 a -saw run becomes the plain run (the factor enters nowhere else); at A=0.5 it is
    another run with the same syncs and bytes."""
    plain = _sim(tmp_path, "plain", "--methods", "allreduce,localsgd-k8,diloco-h8", "--seeds", "0")
    tiny = _sim(tmp_path, "tiny", "--methods", "allreduce,localsgd-k8-saw0.0000001,diloco-h8-saw0.0000001", "--seeds", "0")
    half = _sim(tmp_path, "half", "--methods", "allreduce,localsgd-k8-saw0.5,diloco-h8-saw0.5", "--seeds", "0")
    for a, b, c in zip(plain["runs"][1:], tiny["runs"][1:], half["runs"][1:]):
        va, vb, vc = ([p["val_loss"] for p in r["curve"]] for r in (a, b, c))
        assert vb == pytest.approx(va, rel=1e-5), a["name"]
        assert abs(vc[-1] - va[-1]) > 1e-3, a["name"]
        assert (a["syncs"], a["bytes"]) == (c["syncs"], c["bytes"]) and c["saw"] == 0.5
    assert [p["val_loss"] for p in plain["runs"][0]["curve"]] == [p["val_loss"] for p in half["runs"][0]["curve"]]


def test_drift_noise_reads_each_ranks_gradient_noise_from_its_own_deviation_in_float64():
    """-pvc (the library's denoise_moments="sync" reading): M ranks take Adam-like steps lr * m_i / (bc1 den) from shared params, their first moments a
    stationary AR(1) of their own noisy gradients; after K steps each rank's deviation from the mean params
    gives back the noise variance s^2 (unbiased, per coordinate), and -pvcm's beta is the least-squares
    slope of the last first-moment deviation on S."""
    import torch
    from flodl_opt.hooks import moments as flo_moments
    sim = _load_sim()
    g = torch.Generator().manual_seed(0)
    M, N, K, b1, lr, bc1 = 4, 20000, 16, 0.9, 1e-3, 0.95
    s = torch.rand(N, generator=g, dtype=torch.float64) * 2 + 0.1          # per-coordinate noise scale
    mu = torch.randn(N, generator=g, dtype=torch.float64)                  # the mean gradient, shared
    den = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    m = torch.zeros(M, N, dtype=torch.float64)
    for _ in range(300):                                                   # burn-in: stationary first moments
        m = b1 * m + (1 - b1) * (mu + s * torch.randn(M, N, generator=g, dtype=torch.float64))
    theta = torch.zeros(M, N, dtype=torch.float64)
    dm_sum = torch.zeros(M, N, dtype=torch.float64)
    for _ in range(K):
        m = b1 * m + (1 - b1) * (mu + s * torch.randn(M, N, generator=g, dtype=torch.float64))
        theta -= lr * m / (bc1 * den)
        dm_sum += m - m.mean(0)
    d = theta - theta.mean(0)
    sample, S = sim.drift_noise(d, den, lr, bc1, K, M, b1)
    ratio = sample / s ** 2
    assert float(ratio.mean()) == pytest.approx(1.0, abs=0.03)
    torch.testing.assert_close(S, dm_sum, rtol=1e-9, atol=1e-12)   # S: the window's first-moment deviations
    dm = m - m.mean(0)
    beta = float((dm * S).sum() / (S * S).sum())
    assert sim.drift_m_share(K, b1) == pytest.approx(beta, rel=0.05)
    assert sim.drift_m_share(1, b1) == 1.0 and flo_moments.ar_sum_var(1, b1) == 1.0


def test_denoised_second_moment_at_one_step_is_that_of_the_mean_gradient():
    """After one step from shared moments, -avgmvc's v is the cohort's mean gradient's, in float64."""
    import torch
    sim = _load_sim()
    g = torch.Generator().manual_seed(0)
    M, N, b1, b2 = 4, 1000, 0.9, 0.99
    m0 = torch.randn(N, generator=g, dtype=torch.float64) * 0.1
    v0 = torch.rand(N, generator=g, dtype=torch.float64) + 1.0     # large enough that the floor never binds
    grads = torch.randn(M, N, generator=g, dtype=torch.float64) * 0.3 + 0.2
    m = b1 * m0 + (1 - b1) * grads
    v = b2 * v0 + (1 - b2) * grads ** 2
    want = b2 * v0 + (1 - b2) * grads.mean(0) ** 2                  # one AdamW step on the averaged gradient
    torch.testing.assert_close(sim.shared_moments(m, v, 1)[1], want, rtol=1e-12, atol=1e-15)
    # From v0 = 0 the excess can exceed what is there: floored at mean(v_i) / M, never below it
    v = (1 - b2) * grads ** 2
    got = sim.shared_moments(m, v, 1)[1]
    assert bool((got >= v.mean(0) / M - 1e-15).all()) and bool((got < v.mean(0)).all())


def test_bf16_moment_wire_of_the_sim_rounds_each_share_and_the_sum_once():
    """-mbf16: the mean is within one bf16 rounding of each share and one of the sum of the exact
    mean, and the exact float32 mean is not what comes out (the narrowing is there)."""
    import torch
    sim = _load_sim()
    g = torch.Generator().manual_seed(1)
    M, N, u = 4, 4096, 2.0 ** -8
    m = torch.randn(M, N, generator=g) * 1e-3
    v = torch.rand(M, N, generator=g) * 1e-6 + 1e-8
    exact = (m.double().mean(0), v.double().mean(0))
    got = sim._bf16_mean(m), sim._bf16_mean(v)
    for x, want, e in zip((m, v), exact, got):
        bound = u * (x.double().abs().mean(0) + want.abs()) * 1.001
        assert bool(((e.double() - want).abs() <= bound).all())
        assert bool((e.double() - want).abs().max() > 1e-4 * want.abs().max())
    mf, vf = sim.shared_moments(m, v, 16, bf16=False)
    mb, vb = sim.shared_moments(m, v, 16, bf16=True)
    assert torch.equal(mb, got[0]) and not torch.equal(mf, mb) and not torch.equal(vf, vb)


def _cell(path, ranks, runs):
    cfg = {"ranks": ranks, "steps": 64, "d_model": 16, "layers": 1, "corpus_mb": 0.2, "batch_size": 4, "lr": 3e-3}
    path.write_text(json.dumps({"config": cfg, "runs": [
        {"name": n, "seed": s, "k": k, "outer": o, "final": {"val_loss": loss}} for n, s, k, o, loss in runs]}))
    return str(path)


def test_outer_lr_sweep_pairs_each_run_with_its_setups_allreduce_and_keeps_same_names_apart(tmp_path):
    """Runs of a later cell pair by seed with an earlier cell's all-reduce of the same setup; the same method
    name run with another outer lr stays its own row; runs with an inner option are left out."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import outer_lr_sweep as sweep
    d07 = "DiLoCo(lr=0.7, momentum=0.5, nesterov=True, reset_inner=False, warmup=8)"
    d10 = "DiLoCo(lr=1.0, momentum=0.5, nesterov=True, reset_inner=False, warmup=8)"
    old = _cell(tmp_path / "old.json", 2, [("allreduce", 0, 1, None, 2.0), ("allreduce", 1, 1, None, 4.0),
                                           ("diloco-h16", 0, 16, d07, 2.2), ("diloco-h16", 1, 16, d07, 4.0)])
    new = _cell(tmp_path / "new.json", 2, [("diloco-h16", 0, 16, d10, 2.1), ("diloco-h16", 1, 16, d10, 4.2),
                                           ("diloco-h16-lvc", 0, 16, d10, 9.0)])
    other = _cell(tmp_path / "r4.json", 4, [("allreduce", 0, 1, None, 1.0), ("diloco-h16", 0, 16, d10, 1.5)])
    d09 = d10.replace("momentum=0.5", "momentum=0.9")   # a cell with its own all-reduce (another GPU) pairs with it
    own = _cell(tmp_path / "own.json", 2, [("allreduce", 0, 1, None, 2.5), ("diloco-h16-lr1.0-m0.9", 0, 16, d09, 2.75)])
    rows = sweep.rows(sweep.collect([old, new, other, own]))
    got = {(r["setup"]["ranks"], r["outer_lr"], r["momentum"]): r for r in rows}
    assert got.pop((2, 1.0, 0.9))["gaps"] == pytest.approx([10.0])
    got = {(ranks, lr): r for (ranks, lr, _), r in got.items()}
    assert sorted(got) == [(2, 0.7), (2, 1.0), (4, 1.0)]
    assert got[(2, 0.7)]["gaps"] == pytest.approx([10.0, 0.0])
    assert got[(2, 1.0)]["gaps"] == pytest.approx([5.0, 5.0])
    assert got[(2, 1.0)]["gap_mean"] == pytest.approx(5.0) and got[(2, 1.0)]["gap_sd"] == pytest.approx(0.0)
    assert got[(4, 1.0)]["gaps"] == pytest.approx([50.0])
    assert "| 16 | 1 | 0.5 | 8 |" in sweep.table(rows)
