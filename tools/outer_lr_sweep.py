"""DiLoCo's outer step across study cells: every DiLoCo run against its own seed's all-reduce.

The study report (``tools/convergence_study.py``) pairs runs with the all-reduce of their own cell.
A tuning sweep added later runs in new cells on the same seeds, model and corpus, and its all-reduce
is the earlier cell's (the same seed gives the same run). This tool reads any number of cell JSONs,
groups them by setup (ranks, steps, model, corpus, batch, inner lr), pairs every DiLoCo run by seed
with its group's all-reduce, and labels it by H and the outer step it actually ran (cells that ran before a
default changed carry the same method name with another lr). It prints one table per group, writes
the rows as JSON and, with matplotlib, plots the gap against the outer lr, one line per H and momentum.

    python tools/outer_lr_sweep.py docs/lab/study/wide16k_r4grid/*.json docs/lab/study/wide16k_tuned_h/*.json \\
        --json docs/lab/study/wide16k_tuned_h/sweep.json --png docs/lab/study/wide16k_tuned_h/sweep.png
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _plot  # noqa: E402

# only the outer step varies: no sync-every-step warm-up, inner lr scale, moment option or weight decay change
_PLAIN = re.compile(r"diloco-h\d+(-paper|(-lr[0-9.]+)?(-m[0-9.]+)?(-ow\d+)?)")
_SETUP = ("ranks", "steps", "d_model", "layers", "corpus_mb", "batch_size", "lr")


def _outer(text: str) -> Dict[str, float]:
    """``DiLoCo(lr=1.0, momentum=0.5, ...)`` (the sim's record of the outer step) -> its numbers."""
    inner = text[text.index("(") + 1:text.rindex(")")]
    out = {}
    for part in inner.split(", "):
        key, _, val = part.partition("=")
        if key in ("lr", "momentum", "warmup"):
            out[key] = float(val)
    return out


def collect(paths: List[str]) -> Dict[Tuple, Dict]:
    """setup -> {"allreduce": {seed: loss}, "one-rank": {...}, "diloco": {(h, lr, mu, warmup): {seed: (loss, ref)}}}.

    A run pairs with the all-reduce of its own cell when the cell has one (``ref``; it may have run on
    another GPU than the earlier cells), else with the first all-reduce of its setup and seed.
    """
    groups: Dict[Tuple, Dict] = {}
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        if "runs" not in data:
            continue
        cfg = data["config"]
        key = tuple(cfg.get(k) for k in _SETUP)
        g = groups.setdefault(key, {"allreduce": {}, "one-rank": {}, "diloco": {}})
        own = {r["seed"]: r["final"]["val_loss"] for r in data["runs"] if r["name"] == "allreduce"}
        for r in data["runs"]:
            loss = r["final"]["val_loss"]
            if r["name"] in ("allreduce", "one-rank"):
                g[r["name"]].setdefault(r["seed"], loss)
            elif _PLAIN.fullmatch(r["name"]) and r.get("outer"):
                o = _outer(r["outer"])
                cfg_key = (r["k"], o["lr"], o["momentum"], int(o["warmup"]))
                g["diloco"].setdefault(cfg_key, {})[r["seed"]] = (loss, own.get(r["seed"]))
    return groups


def rows(groups: Dict[Tuple, Dict]) -> List[Dict]:
    out = []
    for key, g in groups.items():
        for (h, lr, mu, warm), by_seed in sorted(g["diloco"].items()):
            base = {s: ref if ref is not None else g["allreduce"].get(s) for s, (_, ref) in by_seed.items()}
            seeds = sorted(s for s in by_seed if base[s] is not None)
            if not seeds:
                continue
            losses = [by_seed[s][0] for s in seeds]
            gaps = [100.0 * (by_seed[s][0] / base[s] - 1.0) for s in seeds]
            one = [g["one-rank"][s] for s in seeds if s in g["one-rank"]]
            out.append({"setup": dict(zip(_SETUP, key)), "H": h, "outer_lr": lr, "momentum": mu, "warmup": warm,
                        "seeds": seeds, "loss_mean": statistics.fmean(losses),
                        "loss_sd": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                        "gap_mean": statistics.fmean(gaps), "gap_sd": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
                        "gaps": gaps, "one_rank_mean": statistics.fmean(one) if one else None})
    return out


def _setups(rs: List[Dict]) -> List[Dict]:
    """The rows' setups in the order they first appear (dicts: not hashable)."""
    out: List[Dict] = []
    for r in rs:
        if r["setup"] not in out:
            out.append(r["setup"])
    return out


def table(rs: List[Dict]) -> str:
    lines = []
    for s in _setups(rs):
        sub = [r for r in rs if r["setup"] == s]
        best = {h: min(r["gap_mean"] for r in sub if r["H"] == h) for h in {r["H"] for r in sub}}
        lines += [f"\n**{s['ranks']} ranks, {s['steps']} steps, d_model {s['d_model']}, corpus {s['corpus_mb']} MB**",
                  "", "| H | outer lr | momentum | warm-up | final val loss | vs allreduce (paired) | per seed | vs one rank |",
                  "|---:|---:|---:|---:|---:|---:|---|---:|"]
        for r in sorted(sub, key=lambda r: (r["H"], r["momentum"], r["outer_lr"])):
            mark = "**" if r["gap_mean"] == best[r["H"]] else ""
            one = "" if r["one_rank_mean"] is None else f"{r['loss_mean'] - r['one_rank_mean']:+.4f}"
            lines.append(f"| {r['H']} | {r['outer_lr']:g} | {r['momentum']:g} | {r['warmup']} | "
                         f"{r['loss_mean']:.4f} +- {r['loss_sd']:.4f} | {mark}{r['gap_mean']:+.2f}% +- "
                         f"{r['gap_sd']:.2f}{mark} | {', '.join(f'{g:.2f}' for g in r['gaps'])} | {one} |")
    return "\n".join(lines)


def plot(rs: List[Dict], path: str) -> None:
    plt = _plot.pyplot()
    if plt is None:
        return
    setups = _setups(rs)
    fig, axes = plt.subplots(1, len(setups), figsize=(5.5 * len(setups), 4.2), squeeze=False)
    for ax, s in zip(axes[0], setups):
        sub = [r for r in rs if r["setup"] == s and r["warmup"] > 0]
        for h, mu in sorted({(r["H"], r["momentum"]) for r in sub}):
            line = sorted((r for r in sub if r["H"] == h and r["momentum"] == mu), key=lambda r: r["outer_lr"])
            ax.errorbar([r["outer_lr"] for r in line], [r["gap_mean"] for r in line],
                        yerr=[r["gap_sd"] for r in line], marker="o", capsize=3, label=f"H={h}, mu {mu:g}")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xlabel("outer lr")
        ax.set_ylabel("final val loss vs all-reduce (%, paired by seed)")
        ax.set_title(f"{s['ranks']} ranks, {s['steps']} steps")
        ax.legend(fontsize=8)
    _plot.save(fig, path, "DiLoCo's outer step (warm-up 8): mean +- sd over seeds")
    print(f"wrote {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cells", nargs="+", help="cell JSONs written by tools/cohort_sim.py")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--png", default=None, help="write the figure here")
    args = p.parse_args(argv)
    rs = rows(collect(args.cells))
    if not rs:
        raise SystemExit("outer_lr_sweep: no DiLoCo run with an all-reduce of the same setup and seed in these cells")
    print(table(rs))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rs, fh, indent=1)
    if args.png:
        plot(rs, args.png)


if __name__ == "__main__":
    main()
