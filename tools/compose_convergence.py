"""Convergence of the composed options against their blocking counterparts, over seeds.

Streaming syncs (``fragments``/``overlap_steps``) with a compressed wire and error feedback, and
``denoise_moments="sync"`` with DiLoCo or a compressed wire, each paired with the configuration it
should match. Every run is a real multi-process run of ``examples/train_charlm.py`` (``--nproc``
local Gloo ranks, default 2), one run at a time (``--nproc`` processes' worth of work), for every
seed. A pair's gap is paired by seed (same init, same data): ``100 * (new - base) / base`` of the
final validation loss (consensus weights, the same fixed windows in every run).

    nice -n 15 python tools/compose_convergence.py --steps 512 --seeds 0,1,2
    python tools/compose_convergence.py --replot          # table, JSON and PNG from the logs
    python tools/compose_convergence.py --only k16,k16-p4t2-int8ef --seeds 0,1 --steps 32

Writes under ``--out`` (default ``docs/lab/compose``): ``runs/<config>-s<seed>.json`` (each run's
log) and ``.out`` (its output), ``compose.json`` (every run, every configuration's mean and spread
over seeds, every pair's gap), ``compose.md`` (the table) and ``compose.png`` (needs matplotlib;
skipped with a message otherwise). Arguments after ``--`` go to every training run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _plot  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_charlm.py")

DILOCO = ["--outer", "diloco", "--sync-every", "64"]
AVG = ["--outer", "avg", "--sync-every", "16"]
STREAM = ["--fragments", "4", "--overlap-steps", "2"]
INT8_EF = ["--wire", "int8", "--error-feedback"]
DSYNC = ["--denoise-moments", "sync"]

# name -> (label, train_charlm arguments)
CONFIGS: Dict[str, Tuple[str, List[str]]] = {
    "diloco-h64": ("DiLoCo H=64 (blocking, fp32)", DILOCO),
    "diloco-h64-p4t2": ("DiLoCo H=64 P=4 tau=2 (fp32)", DILOCO + STREAM),
    "diloco-h64-p4t2-int8ef": ("DiLoCo H=64 P=4 tau=2 int8+EF", DILOCO + STREAM + INT8_EF),
    "k16": ("avg K=16 (blocking, fp32)", AVG),
    "k16-p4t2-int8ef": ("avg K=16 P=4 tau=2 int8+EF", AVG + STREAM + INT8_EF),
    "diloco-h64-dsync": ("DiLoCo H=64 denoise=sync", DILOCO + DSYNC),
    "k16-dsync": ("avg K=16 denoise=sync (fp32)", AVG + DSYNC),
    "k16-int8-dsync": ("avg K=16 int8 denoise=sync", AVG + ["--wire", "int8"] + DSYNC),
}

# (new combination, its counterpart, role): "test" pairs are the cells; "reference" pairs split a
# test gap into its parts (streaming alone, the denoising alone) and cost no extra runs.
PAIRS: List[Tuple[str, str, str]] = [
    ("diloco-h64-p4t2-int8ef", "diloco-h64", "test"),
    ("diloco-h64-p4t2-int8ef", "diloco-h64-p4t2", "test"),
    ("k16-p4t2-int8ef", "k16", "test"),
    ("diloco-h64-dsync", "diloco-h64", "test"),
    ("k16-int8-dsync", "k16-dsync", "test"),
    ("diloco-h64-p4t2", "diloco-h64", "reference"),
    ("k16-dsync", "k16", "reference"),
]


# ----------------------------------------------------------------------------- running
def log_path(out: str, name: str, seed: int) -> str:
    return os.path.join(out, "runs", f"{name}-s{seed}.json")


def command(name: str, seed: int, args, extra: Sequence[str]) -> List[str]:
    return [sys.executable, EXAMPLE, "--nproc", str(args.nproc), "--steps", str(args.steps),
            "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
            "--print-every", str(args.eval_every), "--seed", str(seed),
            "--log", log_path(args.out, name, seed), *CONFIGS[name][1], *extra]


def child_env() -> Dict[str, str]:
    """This checkout's flodl_opt (not whichever is installed), and a fresh rendezvous per run."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_one(cmd: List[str], out_file: str, timeout: float) -> None:
    """One training run in its own process group: killed with its ranks on timeout or interrupt."""
    with open(out_file, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise SystemExit(f"{os.path.basename(out_file)}: no result within {timeout:.0f} s (killed); "
                             f"see {out_file}, or raise --timeout")
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it spawned
            proc.wait()
            raise
    if rc != 0:
        with open(out_file) as fh:
            tail = fh.read()[-3000:]
        raise SystemExit(f"run failed (exit {rc}): {' '.join(cmd[1:])}\n{tail}\n(full output: {out_file})")


def fmt_s(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def run_all(names: List[str], seeds: List[int], args, extra: Sequence[str]) -> None:
    """Seed-major, so that an interrupted campaign leaves whole seeds; --resume skips finished runs."""
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    todo = [(s, n) for s in seeds for n in names
            if not (args.resume and os.path.exists(log_path(args.out, n, s)))]
    t0 = time.perf_counter()
    print(f"{len(todo)} runs ({len(names) * len(seeds) - len(todo)} reused), {args.nproc} ranks each, "
          f"one at a time, {args.steps} steps", flush=True)
    for i, (seed, name) in enumerate(todo, 1):
        cmd = command(name, seed, args, extra)
        print(f"[{i}/{len(todo)}] {name} seed {seed}: {' '.join(cmd[2:])}", flush=True)
        t_run = time.perf_counter()
        run_one(cmd, log_path(args.out, name, seed)[:-5] + ".out", args.timeout)
        final = load(args.out, name, seed)["final"]
        elapsed = time.perf_counter() - t0
        eta = elapsed / i * (len(todo) - i)
        print(f"[{i}/{len(todo)}] {name} seed {seed}: val {final['val_loss']:.4f}, "
              f"{final['bytes'] / 1e6:.2f} MB sent per rank, {time.perf_counter() - t_run:.0f} s | "
              f"elapsed {fmt_s(elapsed)} | ETA {fmt_s(eta)}", flush=True)


def load(out: str, name: str, seed: int) -> Dict:
    with open(log_path(out, name, seed)) as fh:
        return json.load(fh)


# ----------------------------------------------------------------------------- summary
def spread(xs: List[float]) -> Dict[str, float]:
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs)}


def summarize(names: List[str], seeds: List[int], out: str) -> Dict:
    """Every run's final numbers, each configuration over seeds, each pair's seed-paired gap."""
    configs = {}
    for name in names:
        runs = {}
        for seed in seeds:
            res = load(out, name, seed)
            f = res["final"]
            sums = f.get("param_checksums", [])
            runs[str(seed)] = {"val_loss": f["val_loss"], "bytes": f["bytes"], "syncs": f["syncs"],
                               "collectives": f["collectives"], "wall_s": f["wall_s"],
                               # after the closing sync every rank must hold the same weights
                               "ranks_agree": len(set(sums)) <= 1,
                               "log": os.path.relpath(log_path(out, name, seed), out)}
        vals = [r["val_loss"] for r in runs.values()]
        configs[name] = {"label": CONFIGS[name][0], "argv": CONFIGS[name][1], "runs": runs,
                         "val_loss": spread(vals),
                         "mb_sent_per_rank": statistics.fmean(r["bytes"] for r in runs.values()) / 1e6,
                         "syncs": statistics.fmean(r["syncs"] for r in runs.values())}
    pairs = []
    for new, base, role in PAIRS:
        if new in configs and base in configs:
            gaps = [100.0 * (configs[new]["runs"][s]["val_loss"] - configs[base]["runs"][s]["val_loss"])
                    / configs[base]["runs"][s]["val_loss"] for s in map(str, seeds)]
            pairs.append({"new": new, "base": base, "role": role, "gap_pct_per_seed": gaps,
                          "gap_pct": spread(gaps),
                          "bytes_ratio": configs[new]["mb_sent_per_rank"] / configs[base]["mb_sent_per_rank"]
                          if configs[base]["mb_sent_per_rank"] else None})
    return {"configs": configs, "pairs": pairs}


def table(summary: Dict, n_seeds: int) -> str:
    cfg = summary["configs"]
    lines = [f"| method | final val loss (mean of {n_seeds}) | std | min..max | vs | gap % (mean) | gap std "
             "| gap min..max | MB sent per rank | bytes vs |",
             "|---|---:|---:|---|---|---:|---:|---|---:|---:|"]

    def row(name: str, pair: Optional[Dict]) -> str:
        v = cfg[name]["val_loss"]
        cells = [cfg[name]["label"], f"{v['mean']:.4f}", f"{v['std']:.4f}", f"{v['min']:.4f}..{v['max']:.4f}"]
        if pair is None:
            cells += ["-", "-", "-", "-"]
        else:
            g = pair["gap_pct"]
            tag = "" if pair["role"] == "test" else " (reference)"
            cells += [cfg[pair["base"]]["label"] + tag, f"{g['mean']:+.2f}%", f"{g['std']:.2f}",
                      f"{g['min']:+.2f}..{g['max']:+.2f}"]
        ratio = pair and pair["bytes_ratio"]
        cells += [f"{cfg[name]['mb_sent_per_rank']:.2f}", f"{ratio:.2f}x" if ratio else "-"]
        return "| " + " | ".join(cells) + " |"

    compared = {p["new"] for p in summary["pairs"]}
    for name in cfg:  # each baseline once, then every pair of each new combination
        if name not in compared:
            lines.append(row(name, None))
    for pair in summary["pairs"]:
        lines.append(row(pair["new"], pair))
    return "\n".join(lines)


def plot(summary: Dict, seeds: List[int], out: str, path: str) -> Optional[str]:
    """Seed-mean validation loss against steps; each pair's gap, per seed and mean."""
    plt = _plot.pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    late: List[float] = []
    for name, c in summary["configs"].items():
        curves = [load(out, name, s)["curve"] for s in seeds]
        n = min(len(cv) for cv in curves)
        steps = [curves[0][j]["step"] for j in range(1, n)]
        val = [statistics.fmean(cv[j]["val_loss"] for cv in curves) for j in range(1, n)]
        ax1.plot(steps, val, marker=".", label=c["label"])
        late += [v for st, v in zip(steps, val) if st >= steps[-1] / 2]
    if late:  # the first evaluations would squash the differences that matter, at the end
        ax1.set_ylim(min(late) - 0.02, max(late) + 0.02)
    ax1.set_xlabel("step")
    ax1.set_ylabel(f"validation loss, mean of {len(seeds)} seeds (nats/byte)")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize="small")
    pairs = summary["pairs"]
    for i, p in enumerate(pairs):
        ax2.scatter([p["gap_pct_per_seed"][k] for k in range(len(seeds))], [i] * len(seeds),
                    color="gray", s=14, zorder=2)
        ax2.scatter([p["gap_pct"]["mean"]], [i], color="C0" if p["role"] == "test" else "C1", s=50, zorder=3)
    ax2.axvline(0.0, color="black", lw=0.8)
    ax2.set_yticks(range(len(pairs)))
    ax2.set_yticklabels([f"{summary['configs'][p['new']]['label']}\nvs {summary['configs'][p['base']]['label']}"
                         for p in pairs], fontsize="x-small")
    ax2.invert_yaxis()
    ax2.set_xlabel("final val loss gap, % (gray: per seed, dot: mean; orange: reference pair)")
    ax2.grid(alpha=0.3, axis="x")
    cfg = load(out, next(iter(summary["configs"])), seeds[0])["config"]
    title = (f"composed options vs blocking counterparts: char LM, {cfg['world_size']} ranks "
             f"({cfg['backend']}), {cfg['params'] / 1e6:.2f}M params, {cfg['steps']} steps, seeds "
             f"{','.join(map(str, seeds))}")
    return _plot.save(fig, path, title)


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"{os.cpu_count()} CPU cores ({model}), {platform.platform()}"


def git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def report(names: List[str], seeds: List[int], args, argv: List[str]) -> Dict:
    summary = summarize(names, seeds, args.out)
    cfg = load(args.out, names[0], seeds[0])["config"]
    setup = (f"{cfg['world_size']} ranks ({cfg['backend']}), {cfg['params'] / 1e6:.2f}M params "
             f"({cfg['layers']} layers, d_model {cfg['d_model']}, context {cfg['context']}), batch "
             f"{cfg['batch_size']} per rank, {cfg['steps']} steps, seeds {','.join(map(str, seeds))}, "
             f"torch {cfg['torch']}; {machine()}")
    text = table(summary, len(seeds))
    bad = [f"{n} seed {s}" for n, c in summary["configs"].items() for s, r in c["runs"].items()
           if not r["ranks_agree"]]
    print(f"\n{setup}\n\n{text}")
    if bad:
        print(f"\nWARNING: the ranks ended with different weights in: {', '.join(bad)}")
    os.makedirs(args.out, exist_ok=True)
    png = plot(summary, seeds, args.out, os.path.join(args.out, "compose.png"))
    with open(os.path.join(args.out, "compose.md"), "w") as fh:
        fh.write(f"{setup}\n\n{text}\n")
    doc = {"setup": setup, "machine": machine(), "commit": git_commit(),
           "command": " ".join(["python", os.path.relpath(os.path.abspath(__file__), ROOT), *argv]),
           "steps": cfg["steps"], "nproc": cfg["world_size"], "seeds": seeds,
           "ranks_disagree": bad, **summary, "table": text,
           "png": os.path.relpath(png, args.out) if png else None}
    tmp = os.path.join(args.out, "compose.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=1)
    os.replace(tmp, os.path.join(args.out, "compose.json"))
    if png:
        print(f"\nplot: {png}")
    return doc


def parse_args(argv: List[str]):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=512, help="optimizer steps per rank (the demo's default)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; every configuration runs once per seed")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (runs go one at a time)")
    p.add_argument("--eval-every", type=int, default=64, help="steps between validation passes")
    p.add_argument("--eval-batches", type=int, default=16, help="validation batches (the same windows in every run)")
    p.add_argument("--only", default=None, metavar="NAMES",
                   help=f"run only these configurations (comma-separated; of {', '.join(CONFIGS)}); "
                        "a pair is reported when both of its ends ran")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "lab", "compose"))
    p.add_argument("--resume", action="store_true", help="reuse the logs of runs already under --out")
    p.add_argument("--replot", action="store_true", help="only rebuild the table, JSON and PNG from the logs")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per run")
    args = p.parse_args(argv)
    try:
        args.seeds_list = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    args.names = list(CONFIGS) if args.only is None else [n for n in args.only.split(",") if n]
    unknown = [n for n in args.names if n not in CONFIGS]
    if unknown or not args.names:
        p.error(f"--only: unknown configuration(s) {unknown or args.only!r}; known: {', '.join(CONFIGS)}")
    if args.nproc < 2:
        p.error("--nproc must be >= 2: the pairs compare syncs between ranks")
    return args


def main(argv: Optional[List[str]] = None) -> Dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = parse_args(argv)
    # A SIGTERM (a timeout above us) still kills the run in flight with its ranks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.replot:
        run_all(args.names, args.seeds_list, args, extra)
    return report(args.names, args.seeds_list, args, argv + (["--", *extra] if extra else []))


if __name__ == "__main__":
    main()
