"""Check the CUDA path on a GPU machine: the GPU tests, fence removal, NCCL's limits, benchmarks.

Run from the repository root, with nothing installed beyond torch::

    PYTHONPATH=. python tools/gpu_check.py                      # card + GPU tests
    PYTHONPATH=. python tools/gpu_check.py --negative --nccl-two-ranks --suite \\
        --also "python tools/bench_step.py --device cuda"

What it runs, each in its own process with a timeout:

* the card (``nvidia-smi``), torch, CUDA and NCCL versions;
* ``tests/test_gpu.py``: NCCL PREMUL_SUM against float64 at a world of one (factor on the device),
  bf16/fp16 reduced in float32, ranks sharing the GPU over Gloo with CUDA tensors, and the
  stream-ordering stress against a float64 replay;
* ``--negative``: the stress again with a fence removed on purpose (``FLODL_GPU_BREAK``); each of
  these runs is EXPECTED to fail, which shows that the stress test can fail;
* ``--nccl-two-ranks``: whether NCCL accepts two ranks on one GPU (it is expected to refuse);
* ``--suite``: the rest of the test suite (multi-process tests over Gloo) under this torch;
* ``--also CMD``: any further command (benchmarks), its output kept in the log.

It prints a table last and writes ``gpu_check.json`` (and the log, when ``$OUT`` or ``--out`` is set).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _run(name: str, cmd: List[str], timeout: float, extra_env: Optional[Dict[str, str]] = None) -> dict:
    """Run one step, echo its output, and return rc, wall time and the output's last lines."""
    print(f"\n===== {name}: {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=_env(extra_env), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=timeout)
        out, rc = p.stdout.decode(errors="replace"), p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.output or b"").decode(errors="replace") + f"\n[timed out after {timeout:.0f}s]", 124
    print(out, flush=True)
    return {"name": name, "cmd": cmd, "rc": rc, "s": round(time.time() - t0, 1),
            "tail": out.strip().splitlines()[-40:]}


def _pytest_summary(res: dict) -> str:
    for line in reversed(res["tail"]):
        if re.search(r"\d+ (passed|failed|error|skipped)", line):
            return line.strip("= ")
    return f"rc={res['rc']}"


def card_info() -> dict:
    import torch
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(),
            "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001
        info["nccl"] = f"unavailable: {e}"
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                            "--format=csv,noheader"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=30)
        info["nvidia_smi"] = q.stdout.decode().strip().splitlines()
        full = subprocess.run(["nvidia-smi"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
        print(full.stdout.decode(), flush=True)
    except Exception as e:  # noqa: BLE001
        info["nvidia_smi"] = [f"nvidia-smi failed: {e}"]
    if info["cuda_available"]:
        info["name"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        # What LocalSGDOptimizer.step() pays to remember the training stream, next to the public call.
        import timeit
        torch.cuda.init()
        n = 200_000
        key = timeit.timeit(lambda: torch._C._cuda_getCurrentStream(0), number=n) / n * 1e6
        full_stream = timeit.timeit(lambda: torch.cuda.current_stream(0), number=n) / n * 1e6
        info["stream_key_us"], info["current_stream_us"] = round(key, 3), round(full_stream, 3)
    print(json.dumps(info, indent=1), flush=True)
    return info


# ------------------------------------------------------------------ NCCL with two ranks on one GPU
def _nccl_two_ranks_child(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.full((4,), float(rank + 1), device="cuda:0")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print(f"rank {rank}: all_reduce gave {t.tolist()} (expected [3.0]*4)", flush=True)
    dist.destroy_process_group()


def nccl_two_ranks(timeout: float = 120.0) -> dict:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"\n===== nccl-two-ranks: 2 NCCL ranks on cuda:0 (port {port})", flush=True)
    env = _env({"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    procs = [subprocess.Popen([sys.executable, __file__, "--_nccl-child", str(r), str(port)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs, rcs = [], []
    deadline = time.time() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
            rc = p.returncode
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            rc = 124
        outs.append(out.decode(errors="replace"))
        rcs.append(rc)
    for r, o in enumerate(outs):
        print(f"--- rank {r} (rc {rcs[r]})\n{o}", flush=True)
    errors = [line.strip() for o in outs for line in o.splitlines()
              if re.search(r"(Error|error|Duplicate|invalid usage|refus)", line)]
    verdict = "works" if all(rc == 0 for rc in rcs) else ("hangs" if 124 in rcs else "refused")
    return {"name": "nccl-two-ranks-one-gpu", "rc": max(rcs), "verdict": verdict,
            "errors": list(dict.fromkeys(errors))[:8]}


def _order_probe_child(port: int) -> None:
    """Is the current stream ordered after a world-of-one NCCL PREMUL_SUM? Count stale elements."""
    import inspect
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    src = inspect.getsource(dist.all_reduce)
    print("all_reduce tail:", [ln.strip() for ln in src.splitlines() if "wait" in ln or "async_op" in ln][-6:])
    dev = torch.device("cuda", 0)
    for n in (1000, 3001, 4096, 4097, 65536, 65537, 65600, 100000, 100003, 103594, 103616, 262145, 1 << 20,
              (1 << 20) + 10):
        x = torch.randn(n, device=dev)
        buf = x.clone()
        f = torch.full((), 0.37, device=dev)
        dist.all_reduce(buf, op=dist._make_nccl_premul_sum(f))
        torch.cuda.synchronize(dev)
        idx = (buf != x * f).nonzero().flatten().tolist()
        print(f"probe one-rank PREMUL_SUM n={n:8d} (mod 16={n % 16:2d}, mod 64={n % 64:2d}): "
              f"{len(idx)} elements not scaled, at {idx[:3]}{'...' if len(idx) > 3 else ''}"
              f"{' (the last ' + str(n - idx[0]) + ')' if idx and idx[-1] == n - 1 else ''}", flush=True)
    for where in ("default", "side"):
        stream = torch.cuda.current_stream(dev) if where == "default" else torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for n in (3001, 103594, 1 << 20, 1 << 24):
                for variant in ("sync", "async_wait", "sync_synchronize", "sync_host_factor"):
                    bad = 0
                    for _ in range(10):
                        x = torch.randn(n, device=dev)
                        buf = x.clone()
                        f = torch.full((), 0.37, device=dev)
                        op = dist._make_nccl_premul_sum(0.37 if variant == "sync_host_factor" else f)
                        if variant == "async_wait":
                            dist.all_reduce(buf, op=op, async_op=True).wait()
                        else:
                            dist.all_reduce(buf, op=op)
                        if variant == "sync_synchronize":
                            torch.cuda.synchronize(dev)
                        out = buf.clone()  # on the current stream, right after the collective
                        torch.cuda.synchronize(dev)
                        bad += int((out != x * f).sum())
                    print(f"probe stream={where:7s} n={n:9d} {variant:17s} stale elements: {bad}", flush=True)
    dist.destroy_process_group()


def _figures_child(port: int, out: Optional[str]) -> None:
    """Step overhead and sync cost at a world of one on this GPU, as ratios to anchors in this run."""
    import statistics
    import torch
    import torch.distributed as dist
    from torch import nn
    import flodl_opt as flo
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    flo.init()
    dev = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = True
    results: dict = {"step": [], "sync": []}

    def timed(fn, n):  # seconds per call, device work included
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) / n

    # ---- non-sync step() overhead against the bare loop
    def mlp(width, depth):
        torch.manual_seed(0)
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        return nn.Sequential(*layers).to(dev)

    for label, width, depth, batch in (("small 4x256", 256, 4, 32), ("mid 8x2048", 2048, 8, 256),
                                       ("large 8x8192", 8192, 8, 64)):
        for clip in (None, 1.0):
            models, opts = {}, {}
            for kind in ("bare", "wrapped"):
                m = mlp(width, depth)
                inner = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
                opts[kind] = inner if kind == "bare" else flo.LocalSGDOptimizer(
                    inner, model=m, sync_every=10 ** 9, max_grad_norm=clip)
                models[kind] = m
            x = torch.randn(batch, width, device=dev)

            def make_step(kind):
                m, o = models[kind], opts[kind]
                def step():
                    o.zero_grad(set_to_none=True)
                    m(x).float().pow(2).mean().backward()
                    if kind == "bare" and clip is not None:
                        torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
                    o.step()
                return step
            steps = {k: make_step(k) for k in models}
            for k in steps:
                timed(steps[k], 20)
            per = {k: [] for k in steps}
            n = 200 if width <= 2048 else 40
            for _ in range(11):  # interleaved blocks: drift hits both alike
                for k in steps:
                    per[k].append(timed(steps[k], n))
            med = {k: statistics.median(v) * 1e6 for k, v in per.items()}
            spread = {k: (max(v) - min(v)) / statistics.median(v) for k, v in per.items()}
            row = {"model": label, "params_M": round(sum(p.numel() for p in models["bare"].parameters()) / 1e6, 2),
                   "clip": clip, "bare_us": round(med["bare"], 1), "wrapped_us": round(med["wrapped"], 1),
                   "ratio": round(med["wrapped"] / med["bare"], 4),
                   "ratio_of_min": round(min(per["wrapped"]) / min(per["bare"]), 4),
                   "spread": round(max(spread.values()), 4)}
            results["step"].append(row)
            print("step", row, flush=True)
            del models, opts, steps

    # ---- sync against raw all_reduce and a copy of the same bytes
    for numel in (1 << 20, 16 << 20, 128 << 20):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(numel // 4, device=dev)) for _ in range(4)]
        m = nn.Module()
        m.w = nn.ParameterList(params)
        opt = flo.LocalSGDOptimizer(torch.optim.SGD(params, lr=0.0), model=m, sync_every=10 ** 9)
        flat = opt._param_groups_flat[0].flat
        other = torch.empty_like(flat)
        reps = 50 if numel <= (16 << 20) else 20

        def raw():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)

        def raw_premul():
            dist.all_reduce(flat, op=dist._make_nccl_premul_sum(1.0))

        def copy():
            other.copy_(flat)

        def sync():
            opt.step()
            opt.sync()

        def step_only():
            opt.step()

        rows = {}
        for name, fn in (("copy", copy), ("raw_allreduce_sum", raw), ("raw_allreduce_premul", raw_premul),
                         ("step_only", step_only), ("sync_world1", sync)):
            timed(fn, 5)
            rows[name] = statistics.median(timed(fn, reps) for _ in range(5)) * 1e3
        opt._consensus.distributed = True  # the NCCL path at a world of one (count + PREMUL_SUM)
        timed(sync, 5)
        rows["sync_forced_nccl"] = statistics.median(timed(sync, reps) for _ in range(5)) * 1e3
        opt._consensus.distributed = False
        step_ms = rows["step_only"]
        row = {"params_M": numel / 2 ** 20, "ms": {k: round(v, 4) for k, v in rows.items()},
               "sync_world1_minus_step_ms": round(rows["sync_world1"] - step_ms, 4),
               "sync_forced_nccl_minus_step_ms": round(rows["sync_forced_nccl"] - step_ms, 4)}
        row["ratio_sync_world1_to_allreduce"] = round(row["sync_world1_minus_step_ms"] / rows["raw_allreduce_sum"], 3)
        row["ratio_sync_nccl_to_allreduce"] = round(row["sync_forced_nccl_minus_step_ms"] / rows["raw_allreduce_sum"], 3)
        row["ratio_sync_nccl_to_premul"] = round(row["sync_forced_nccl_minus_step_ms"] / rows["raw_allreduce_premul"], 3)
        row["ratio_sync_world1_to_copy"] = round(row["sync_world1_minus_step_ms"] / rows["copy"], 3)
        results["sync"].append(row)
        print("sync", row, flush=True)
        del opt, params, m, flat, other
        torch.cuda.empty_cache()

    print("\n%-14s %6s %5s %11s %11s %7s %7s %7s" % ("model", "M", "clip", "bare us", "wrapped us", "ratio",
                                                     "min/min", "spread"))
    for r in results["step"]:
        print("%-14s %6.2f %5s %11.1f %11.1f %7.4f %7.4f %7.3f" % (
            r["model"], r["params_M"], r["clip"], r["bare_us"], r["wrapped_us"], r["ratio"],
            r["ratio_of_min"], r["spread"]))
    print("\n%6s %9s %9s %9s %10s %10s %9s %9s" % ("M", "copy ms", "ar ms", "premul", "sync w1", "sync nccl",
                                                   "w1/ar", "nccl/ar"))
    for r in results["sync"]:
        ms = r["ms"]
        print("%6.0f %9.4f %9.4f %9.4f %10.4f %10.4f %9.2f %9.2f" % (
            r["params_M"], ms["copy"], ms["raw_allreduce_sum"], ms["raw_allreduce_premul"],
            r["sync_world1_minus_step_ms"], r["sync_forced_nccl_minus_step_ms"],
            r["ratio_sync_world1_to_allreduce"], r["ratio_sync_nccl_to_allreduce"]))
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_figures.json"), "w") as f:
            json.dump(results, f, indent=1)
    flo.shutdown()
    dist.destroy_process_group()


def figures(out: Optional[str], timeout: float) -> dict:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--_figures-child", str(port)] + (["--out", out] if out else [])
    return _run("figures", cmd, timeout)


def _align_probe_child() -> None:
    """Optimizer step time on separate params vs views into one flat buffer (interleaved rounds)."""
    import statistics
    import torch
    import _bench_common as bc
    dev = torch.device("cuda", 0)
    layouts = (("separate", 0), ("flat", 1), ("flat 16B", 4), ("flat 256B", 64))
    for total in (2_000_000, 50_000_000):
        sizes = bc.model_like_sizes(total, 40, seed=7)
        for name, make in (("AdamW foreach", lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True)),
                           ("AdamW fused", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)),
                           ("SGD foreach", lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=True))):
            opts = {}
            for layout, align in layouts:
                params = [torch.nn.Parameter(torch.randn(k, device=dev)) for k in sizes]
                if align:
                    offs, n = [], 0
                    for k in sizes:
                        n = (n + align - 1) // align * align
                        offs.append(n)
                        n += k
                    flat = torch.zeros(n, device=dev)
                    for t, k, o in zip(params, sizes, offs):
                        flat[o:o + k].copy_(t.data)
                        t.data = flat[o:o + k]
                for t in params:
                    t.grad = torch.randn_like(t) * 0.01
                opts[layout] = make(params)
                for _ in range(5):
                    opts[layout].step()
            times = {k: [] for k in opts}
            order = list(opts)
            for r in range(12):  # rotate the order every round: drift and clocks hit all alike
                for layout in order[r % len(order):] + order[:r % len(order)]:
                    torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    for _ in range(20):
                        opts[layout].step()
                    torch.cuda.synchronize(dev)
                    times[layout].append((time.perf_counter() - t0) / 20 * 1e3)
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"align {total / 1e6:4.0f}M {name:14s} " + " | ".join(
                f"{k} {v:.3f} ms (x{v / med['separate']:.3f})" for k, v in med.items()), flush=True)
            del opts


def order_probe(timeout: float = 180.0) -> dict:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _run("nccl-order-probe", [sys.executable, __file__, "--_probe-child", str(port)], timeout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--negative", action="store_true", help="run the stress with fences removed (expect failure)")
    ap.add_argument("--nccl-two-ranks", action="store_true", help="try 2 NCCL ranks on one GPU")
    ap.add_argument("--suite", action="store_true", help="also run the rest of the test suite")
    ap.add_argument("--also", action="append", default=[], help="a further command to run (repeatable)")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per step")
    ap.add_argument("--suite-timeout", type=float, default=300, help="seconds for --suite")
    ap.add_argument("--suite-workers", type=int, default=4, help="pytest-xdist workers for --suite")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json")
    ap.add_argument("--no-tests", action="store_true", help="only the probes asked for")
    ap.add_argument("--probe", action="store_true", help="stream-order probe of a world-of-one PREMUL_SUM")
    ap.add_argument("--_nccl-child", nargs=2, type=int, help=argparse.SUPPRESS, dest="nccl_child")
    ap.add_argument("--_probe-child", type=int, help=argparse.SUPPRESS, dest="probe_child")
    ap.add_argument("--align", action="store_true", help="optimizer step on flat views: aligned or not")
    ap.add_argument("--_align-child", action="store_true", help=argparse.SUPPRESS, dest="align_child")
    ap.add_argument("--figures", action="store_true", help="step overhead and sync cost at a world of one")
    ap.add_argument("--_figures-child", type=int, help=argparse.SUPPRESS, dest="figures_child")
    args = ap.parse_args(argv)
    if args.nccl_child:
        _nccl_two_ranks_child(*args.nccl_child)
        return 0
    if args.probe_child:
        _order_probe_child(args.probe_child)
        return 0
    if args.align_child:
        sys.path.insert(0, os.path.join(ROOT, "tools"))
        _align_probe_child()
        return 0
    if args.figures_child:
        _figures_child(args.figures_child, args.out)
        return 0

    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    report["card"] = card_info()
    steps = []
    py = sys.executable
    if args.probe:
        steps.append(order_probe())
    if args.align:
        steps.append(_run("align-probe", [py, __file__, "--_align-child"], args.timeout))
    if args.no_tests:
        report["steps"] = steps
        print("\n".join(line for s in steps for line in s.get("tail", [])[-12:]))
        return 0
    res = _run("gpu-tests", [py, "-m", "pytest", "-v", "-s", "-rA", "-p", "no:cacheprovider",
                             "tests/test_gpu.py"], args.timeout)
    res["summary"] = _pytest_summary(res)
    steps.append(res)
    if args.negative:
        for brk, sel in (("fence", "stress and cross_stream"), ("nccl_wait", "(stress and in_step) or premul or large_bf16")):
            res = _run(f"negative-{brk}", [py, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                                           "tests/test_gpu.py", "-k", sel], args.timeout,
                       {"FLODL_GPU_BREAK": brk})
            res["summary"] = _pytest_summary(res)
            res["expected"] = "fail"
            res["caught"] = res["rc"] not in (0, 124)
            steps.append(res)
    if args.nccl_two_ranks:
        steps.append(nccl_two_ranks())
    report["steps"] = steps

    def save() -> None:  # after every step: a run cut short still leaves what it did
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
                json.dump(report, f, indent=1)

    save()
    if args.figures:
        steps.append(figures(args.out, args.timeout))
        save()
    for cmd in args.also:
        steps.append(_run(f"also: {cmd}", shlex.split(cmd), args.timeout))
        save()
    if args.suite:
        # One worker per test file when pytest-xdist is there: files stay sequential inside.
        try:
            import xdist  # noqa: F401
            par = ["-n", str(args.suite_workers), "--dist", "loadfile"] if args.suite_workers > 1 else []
        except ImportError:
            par = []
        res = _run("suite", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *par, "tests",
                             "--ignore=tests/test_gpu.py"], args.suite_timeout)
        res["summary"] = _pytest_summary(res)
        steps.append(res)
        save()

    print("\n===== summary")
    print(f"card: {report['card'].get('name')} | torch {report['card']['torch']} | CUDA "
          f"{report['card']['cuda']} | NCCL {report['card']['nccl']}")
    for s in steps:
        what = s.get("summary") or s.get("verdict") or f"rc={s['rc']}"
        note = ""
        if "expected" in s:
            note = "  (expected to fail: " + ("CAUGHT" if s["caught"] else "NOT caught") + ")"
        print(f"{s['name'][:60]:60s} {what}{note}")
    save()
    ok = all(s["rc"] == 0 for s in steps if "expected" not in s and not s["name"].startswith("nccl-two"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
