"""Convergence against communication: the synchronous baseline, local SGD and DiLoCo on one budget.

Runs ``examples/train_charlm.py`` (2 local CPU ranks over Gloo by default) for the same number of
steps, batch, seed and data with:

* ``allreduce``: the synchronous baseline, gradients averaged every step (``--mode allreduce``,
  ``flodl_opt.DistributedOptimizer``); the reference the others are compared with;
* ``sync-k1``: model averaging every step (K=1), the other synchronous baseline;
* ``localsgd-k16``: local SGD, plain averaging every 16 steps;
* ``diloco-h64``: DiLoCo with the library defaults every 64 steps;
* optionally ``slowmo-k16`` (``--slowmo``) and extra DiLoCo outer settings (``--diloco lr:momentum``);
* optionally compressed syncs (``--wire bf16 --wire int8``, ``--wire int8+ef`` for error feedback):
  ``localsgd-k16-<wire>`` and ``diloco-h64-<wire>``, the same runs sending bf16/fp16/int8
  differences; compare each with its float32 twin (same seed, same data).

``--adaptive`` runs the adaptive-period study instead: plain averaging with a fixed K of 4, 16
and 64 against ``--sync-every auto`` (``flodl_opt.AdaptiveSync``), over ``--seeds`` (e.g.
``0,1,2``; one directory per seed under ``--out``). It prints the seed-mean table and whether
auto's loss-vs-bytes point dominates the fixed-K frontier, and writes ``adaptive.png``.

    nice -n 15 python tools/compare_convergence.py --adaptive --seeds 0,1,2 --steps 512 \
        --out runs/adaptive

It collects each run's final validation loss (consensus weights, same fixed windows for all runs),
param syncs, collectives and bytes each rank handed to collectives, and writes a table (stdout,
``table.md`` and ``summary.json``) and ``convergence.png``: validation loss against steps and
against bytes communicated (needs matplotlib: ``pip install flodl-opt[plot]``; skipped with a
message otherwise).

    nice -n 15 python tools/compare_convergence.py --steps 1024 --out runs/convergence
    python tools/compare_convergence.py --replot --out runs/convergence   # table + PNG from the logs

Arguments after ``--`` go to every training run (e.g. ``-- --layers 3 --lr 1e-3``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _plot  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_charlm.py")


def has_allreduce() -> bool:
    sys.path.insert(0, ROOT)
    try:
        import flodl_opt
        return hasattr(flodl_opt, "DistributedOptimizer")
    except ImportError:
        return False
    finally:
        sys.path.remove(ROOT)


def plan(args) -> List[Dict]:
    """The runs: name, label, arguments for train_charlm, and its sync period."""
    runs = []
    if args.adaptive:
        runs = [{"name": f"k{k}", "label": f"local SGD, K={k}", "k": k,
                 "argv": ["--sync-every", str(k), "--outer", "avg"]} for k in (4, 16, 64)]
        argv = ["--sync-every", "auto", "--outer", "avg"]
        if args.auto_target is not None:
            argv += ["--auto-target", str(args.auto_target)]
        runs.append({"name": "auto", "label": "local SGD, K auto", "k": "auto", "argv": argv})
        return runs
    if has_allreduce() and not args.no_allreduce:
        runs.append({"name": "allreduce", "label": "sync: gradient allreduce every step", "k": 1,
                     "argv": ["--mode", "allreduce"]})
    runs += [{"name": "sync-k1", "label": "sync: model averaging every step (K=1)", "k": 1,
              "argv": ["--sync-every", "1", "--outer", "avg"]},
             {"name": "localsgd-k16", "label": "local SGD, K=16", "k": 16,
             "argv": ["--sync-every", "16", "--outer", "avg"]},
            {"name": "diloco-h64", "label": "DiLoCo, H=64 (library defaults)", "k": 64,
             "argv": ["--sync-every", "64", "--outer", "diloco"]}]
    if args.slowmo:
        runs.append({"name": "slowmo-k16", "label": "SlowMo, K=16 (lr 1, mom 0.5)", "k": 16,
                     "argv": ["--sync-every", "16", "--outer", "slowmo"]})
    for spec in args.diloco:
        lr, mom = spec.split(":")
        runs.append({"name": f"diloco-h64-lr{lr}-m{mom}", "label": f"DiLoCo, H=64 (lr {lr}, mom {mom})",
                     "k": 64, "argv": ["--sync-every", "64", "--outer", "diloco",
                                       "--outer-lr", lr, "--outer-momentum", mom]})
    for spec in args.wire:
        mode, _, ef = spec.partition("+")
        flags = ["--wire", mode] + (["--error-feedback"] if ef == "ef" else [])
        runs.append({"name": f"localsgd-k16-{spec}", "label": f"local SGD, K=16, wire {spec}", "k": 16,
                     "argv": ["--sync-every", "16", "--outer", "avg", *flags]})
        runs.append({"name": f"diloco-h64-{spec}", "label": f"DiLoCo, H=64, wire {spec}", "k": 64,
                     "argv": ["--sync-every", "64", "--outer", "diloco", *flags]})
    for spec in args.run:
        name, _, rest = spec.partition("=")
        argv = rest.split()
        k = argv[argv.index("--sync-every") + 1] if "--sync-every" in argv else "16"
        k = int(k) if k.isdigit() else k
        runs.append({"name": name, "label": name, "k": k, "argv": argv})
    if args.only:
        keep = args.only.split(",")
        runs = [r for r in runs if r["name"] in keep]
    return runs


def run_one(run: Dict, args, extra: List[str]) -> Dict:
    log = os.path.join(args.out, f"{run['name']}.json")
    if args.replot or (args.resume and os.path.exists(log)):
        with open(log) as fh:
            return json.load(fh)
    cmd = [sys.executable, EXAMPLE, "--nproc", str(args.nproc), "--steps", str(args.steps),
           "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
           "--print-every", str(args.eval_every), "--seed", str(args.seed), "--log", log,
           *run["argv"], *extra]
    print(f"\n== {run['name']}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(os.path.join(args.out, f"{run['name']}.out"), "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            for line in proc.stdout:
                out.write(line)
                if not args.quiet:
                    print("   " + line, end="", flush=True)
            rc = proc.wait(timeout=args.timeout)
        except BaseException:
            os.killpg(proc.pid, 9)  # the launcher and its ranks
            raise
    if rc != 0:
        raise SystemExit(f"{run['name']} failed (exit {rc}); see {out.name}")
    print(f"   ({time.perf_counter() - t0:.0f} s)")
    with open(log) as fh:
        return json.load(fh)


def table(runs: List[Dict], results: List[Dict]) -> (str, List[Dict]):
    """Markdown table and rows; losses relative to the first run (and to K=1 model averaging)."""
    base = results[0]["final"]
    k1 = next((res["final"] for run, res in zip(runs[1:], results[1:]) if run["name"] == "sync-k1"), None)
    rows = []
    for run, res in zip(runs, results):
        f = res["final"]
        rows.append({
            "run": run["name"], "label": run["label"], "sync_every": run["k"],
            "final_val_loss": f["val_loss"],
            "vs_first_pct": 100.0 * (f["val_loss"] - base["val_loss"]) / base["val_loss"],
            "vs_k1_pct": 100.0 * (f["val_loss"] - k1["val_loss"]) / k1["val_loss"] if k1 else None,
            "syncs": f["syncs"], "collectives": f["collectives"], "bytes": f["bytes"],
            "fewer_syncs_x": (base["syncs"] / f["syncs"]) if f["syncs"] and f["bytes"] else None,
            "fewer_bytes_x": (base["bytes"] / f["bytes"]) if f["bytes"] else None,
            "wall_s": f["wall_s"],
        })
    cols = ["run", "final val loss", f"vs {runs[0]['name']}"] + (["vs sync-k1"] if k1 else []) + \
        ["syncs", "fewer syncs", "collectives", "MB sent per rank", "fewer bytes", "wall s"]
    lines = ["| " + " | ".join(cols) + " |", "|---" + "|---:" * (len(cols) - 1) + "|"]

    def x(v):
        return f"{v:.1f}x" if v else "-"

    for r in rows:
        cells = [r["label"], f"{r['final_val_loss']:.4f}", f"{r['vs_first_pct']:+.2f}%"]
        if not r["bytes"]:  # one rank: nothing communicated
            r["syncs"] = 0
        if k1:
            cells.append(f"{r['vs_k1_pct']:+.2f}%")
        cells += [str(r["syncs"]), x(r["fewer_syncs_x"]), str(r["collectives"]), f"{r['bytes'] / 1e6:.1f}",
                  x(r["fewer_bytes_x"]), f"{r['wall_s']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), rows


def plot(runs: List[Dict], results: List[Dict], path: str) -> Optional[str]:
    plt = _plot.pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run, res in zip(runs, results):
        curve = res["curve"]
        steps = [p["step"] for p in curve]
        val = [p["val_loss"] for p in curve]
        ax1.plot(steps, val, marker=".", label=run["label"])
        pts = [(p["bytes"] / 1e6, p["val_loss"]) for p in curve if p["bytes"] > 0]
        ax2.plot([b for b, _ in pts], [v for _, v in pts], marker=".", label=run["label"])
    cfg = results[0]["config"]
    for ax in (ax1, ax2):
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
        lo = min(p["val_loss"] for res in results for p in res["curve"])
        first = sorted(p["val_loss"] for res in results for p in res["curve"] if p["step"] > 0)
        ax.set_ylim(lo - 0.05, first[-1] + 0.05 if first else None)
    ax1.set_xlabel("step")
    ax2.set_xlabel("MB handed to collectives per rank (log)")
    ax2.set_xscale("log")
    ax1.legend(fontsize="small")
    title = (f"char LM on the Python stdlib: {cfg['world_size']} ranks, {cfg['params'] / 1e6:.2f}M params, "
             f"batch {cfg['batch_size']}x{cfg['context']} per rank")
    return _plot.save(fig, path, title, dpi=110)


def _mean(xs: List[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: List[float]) -> float:
    m = _mean(xs)
    return (sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)) ** 0.5


def _frontier_loss(points: List[tuple], at_bytes: float) -> Optional[float]:
    """Fixed-K frontier (bytes, loss) interpolated linearly in log(bytes); None outside it."""
    import math
    pts = sorted(points)
    for (b0, l0), (b1, l1) in zip(pts, pts[1:]):
        if b0 <= at_bytes <= b1:
            t = (math.log(at_bytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
            return l0 + t * (l1 - l0)
    return None


def adaptive_summary(runs: List[Dict], per_seed: List[List[Dict]], seeds: List[int]):
    """Seed-mean table of the fixed K against auto, and the dominance verdict."""
    rows = []
    for i, run in enumerate(runs):
        finals = [res[i]["final"] for res in per_seed]
        ks = [p.get("sync_every") for res in per_seed for p in res[i]["curve"][1:]]
        rows.append({"run": run["name"], "label": run["label"],
                     "val_loss": _mean([f["val_loss"] for f in finals]),
                     "val_loss_std": _std([f["val_loss"] for f in finals]),
                     "per_seed": [f["val_loss"] for f in finals],
                     "syncs": _mean([f["syncs"] for f in finals]),
                     "bytes": _mean([f["bytes"] for f in finals]),
                     "k_range": [min(k for k in ks if k), max(k for k in ks if k)]
                     if run["k"] == "auto" and any(ks) else None})
    fixed = [r for r in rows if r["run"] != "auto"]
    auto = next((r for r in rows if r["run"] == "auto"), None)
    lines = ["| run | final val loss (mean of %d seeds) | std | per seed | syncs | MB sent per rank |"
             % len(seeds), "|---|---:|---:|---|---:|---:|"]
    for r in rows:
        label = r["label"] + (f" (K {r['k_range'][0]}..{r['k_range'][1]})" if r["k_range"] else "")
        lines.append(f"| {label} | {r['val_loss']:.4f} | {r['val_loss_std']:.4f} | "
                     + " / ".join(f"{v:.4f}" for v in r["per_seed"])
                     + f" | {r['syncs']:.1f} | {r['bytes'] / 1e6:.1f} |")
    verdict = {}
    if auto is not None and fixed:
        reach = [r for r in fixed if r["val_loss"] <= auto["val_loss"]]
        best = min(reach, key=lambda r: r["bytes"]) if reach else None
        at = _frontier_loss([(r["bytes"], r["val_loss"]) for r in fixed], auto["bytes"])
        verdict = {
            "cheapest_fixed_reaching_auto_loss": best["run"] if best else None,
            "bytes_saved_x": best["bytes"] / auto["bytes"] if best else None,
            "frontier_loss_at_auto_bytes": at,
            "dominates": (best is None or auto["bytes"] < best["bytes"]) and
                         (at is None or auto["val_loss"] < at),
        }
        lines.append("")
        if best:
            lines.append(f"auto reaches {auto['val_loss']:.4f}: the cheapest fixed K that reaches it is "
                         f"{best['label']} with {best['bytes'] / auto['bytes']:.2f}x auto's bytes")
        else:
            lines.append(f"auto's {auto['val_loss']:.4f} is lower than every fixed K's final loss")
        if at is not None:
            lines.append(f"fixed-K frontier at auto's {auto['bytes'] / 1e6:.1f} MB (log-bytes "
                         f"interpolation): {at:.4f} vs auto {auto['val_loss']:.4f}")
        lines.append(f"auto dominates the fixed-K frontier: {'yes' if verdict['dominates'] else 'no'}")
    return "\n".join(lines), rows, verdict


def plot_adaptive(runs: List[Dict], per_seed: List[List[Dict]], path: str) -> Optional[str]:
    """Seed-mean validation loss against steps, bytes, and the K auto picked."""
    plt = _plot.pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, run in enumerate(runs):
        curves = [res[i]["curve"] for res in per_seed]
        n = min(len(c) for c in curves)
        steps = [curves[0][j]["step"] for j in range(n)]
        val = [_mean([c[j]["val_loss"] for c in curves]) for j in range(n)]
        mb = [_mean([c[j]["bytes"] for c in curves]) / 1e6 for j in range(n)]
        style = dict(marker=".", lw=2.5 if run["k"] == "auto" else 1.5)
        ax1.plot(steps, val, label=run["label"], **style)
        ax2.plot(mb[1:], val[1:], label=run["label"], **style)
        ks = [[c[j].get("sync_every") or run["k"] for c in curves] for j in range(1, n)]
        if run["k"] == "auto":
            for s in range(len(curves)):
                ax3.plot(steps[1:], [k[s] for k in ks], marker=".", alpha=0.7, label=f"auto, seed {s}")
        else:
            ax3.axhline(run["k"], ls=":", color="gray")
    cfg = per_seed[0][0]["config"]
    for ax in (ax1, ax2):
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
    ax1.set_xlabel("step")
    ax1.set_ylim(None, 3.0)
    ax2.set_ylim(None, 3.0)
    ax2.set_xlabel("MB handed to collectives per rank (log)")
    ax2.set_xscale("log")
    ax3.set_xlabel("step")
    ax3.set_ylabel("K in effect at the evaluation")
    ax3.set_yscale("log", base=2)
    ax3.grid(alpha=0.3)
    ax1.legend(fontsize="small")
    ax3.legend(fontsize="small")
    title = (f"adaptive sync period, char LM: {cfg['world_size']} ranks, {cfg['steps']} steps, "
             f"mean of {len(per_seed)} seeds")
    return _plot.save(fig, path, title, dpi=110)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1024)
    p.add_argument("--eval-every", type=int, default=64, help="a multiple of 64: evaluations follow a sync")
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default=None, metavar="S1,S2,...",
                   help="run every configuration once per seed (one directory per seed under --out)")
    p.add_argument("--adaptive", action="store_true",
                   help="the adaptive-period study: fixed K 4/16/64 against --sync-every auto")
    p.add_argument("--auto-target", type=float, default=None,
                   help="with --adaptive: the AdaptiveSync target of the auto run")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "convergence"))
    p.add_argument("--slowmo", action="store_true", help="also run SlowMo K=16")
    p.add_argument("--diloco", action="append", default=[], metavar="LR:MOMENTUM",
                   help="also run DiLoCo H=64 with this outer lr and momentum (repeatable)")
    p.add_argument("--wire", action="append", default=[], metavar="MODE[+ef]",
                   help="also run local SGD K=16 and DiLoCo H=64 with this compressed wire "
                        "(bf16, fp16, int8; '+ef' adds error feedback; repeatable)")
    p.add_argument("--run", action="append", default=[], metavar="NAME=ARGS",
                   help="also run train_charlm with these arguments, e.g. "
                        "'diloco-w128=--sync-every 64 --outer diloco --warmup-syncs 128' (repeatable)")
    p.add_argument("--only", default=None, metavar="NAMES",
                   help="run only these runs (comma-separated names; the first is the reference)")
    p.add_argument("--no-allreduce", action="store_true",
                   help="skip the gradient-allreduce run: model averaging every step is the baseline")
    p.add_argument("--resume", action="store_true", help="reuse the logs of runs already in --out")
    p.add_argument("--replot", action="store_true", help="only rebuild the table and PNG from --out")
    p.add_argument("--timeout", type=float, default=3600, help="seconds allowed per run")
    p.add_argument("--quiet", action="store_true", help="do not echo the runs' progress")
    p.add_argument("--study", default=None, metavar="PLAN",
                   help="the seeds x budgets x ranks x methods study (tools/convergence_study.py) on "
                        "in-process cohorts (tools/cohort_sim.py): demo2, demo4, big, all, smoke; "
                        "with --replot only the report of the cells under --out")
    p.add_argument("--jobs", type=int, default=1, help="--study: cells run at a time")
    p.add_argument("--device", default=None, help="--study: cuda or cpu (default: cuda when available)")
    p.add_argument("--cells", default=None, help="--study: run only these cells (comma-separated tags)")
    p.add_argument("--figures", default=None, help="--study: where the PNGs go (default: --out)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.study:
        sys.path.insert(0, os.path.join(ROOT, "tools"))
        import convergence_study as study
        if not args.replot:
            device = args.device
            if device is None:
                import torch
                device = "cuda" if torch.cuda.is_available() else "cpu"
            study.run_cells(args.study, args.out, args.jobs, device, args.cells, args.timeout)
        study.report(args.out, args.figures)
        return

    runs = plan(args)
    if args.seeds:
        seeds, root = [int(s) for s in args.seeds.split(",")], args.out
        per_seed = []
        for n, seed in enumerate(seeds):
            args.seed, args.out = seed, os.path.join(root, f"seed{seed}")
            os.makedirs(args.out, exist_ok=True)
            print(f"\n=== seed {seed} ({n + 1}/{len(seeds)})", flush=True)
            per_seed.append([run_one(r, args, extra) for r in runs])
        args.out = root
        text, rows, verdict = adaptive_summary(runs, per_seed, seeds)
        cfg = per_seed[0][0]["config"]
        setup = (f"{cfg['world_size']} ranks ({cfg['backend']}), {cfg['params'] / 1e6:.2f}M params, "
                 f"batch {cfg['batch_size']} per rank, {cfg['steps']} steps, seeds {args.seeds}, "
                 f"torch {cfg['torch']}")
        print(f"\n{setup}\n\n{text}")
        png = plot_adaptive(runs, per_seed, os.path.join(root, "adaptive.png"))
        with open(os.path.join(root, "table.md"), "w") as fh:
            fh.write(f"{setup}\n\n{text}\n")
        with open(os.path.join(root, "summary.json"), "w") as fh:
            json.dump({"setup": setup, "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                       "rows": rows, "verdict": verdict, "png": png}, fh, indent=1)
        if png:
            print(f"\nplot: {png}")
        return
    results = [run_one(r, args, extra) for r in runs]
    text, rows = table(runs, results)
    cfg = results[0]["config"]
    setup = (f"{cfg['world_size']} ranks ({cfg['backend']}), {cfg['params'] / 1e6:.2f}M params "
             f"({cfg['layers']} layers, d_model {cfg['d_model']}, context {cfg['context']}), "
             f"batch {cfg['batch_size']} per rank, {cfg['steps']} steps, seed {cfg['seed']}, torch {cfg['torch']}")
    print(f"\n{setup}\n\n{text}")
    png = plot(runs, results, os.path.join(args.out, "convergence.png"))
    with open(os.path.join(args.out, "table.md"), "w") as fh:
        fh.write(f"{setup}\n\n{text}\n")
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        json.dump({"setup": setup, "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                   "rows": rows, "png": png}, fh, indent=1)
    if png:
        print(f"\nplot: {png}")


if __name__ == "__main__":
    main()
