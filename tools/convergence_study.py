"""The convergence study: a grid of cohorts (budget x ranks x model x method x seed) and its report.

Run through ``tools/compare_convergence.py --study PLAN``. Each cell (one model, one rank count,
one budget) is one ``tools/cohort_sim.py`` process that trains every method and seed of the cell
as one batched model; cells run ``--jobs`` at a time. The report reads every cell's JSON under
``--out`` and writes, per cell: mean and spread over seeds of the final validation loss, the gap to
gradient all-reduce (paired by seed: same init and data), syncs and bytes; and a figure with the
loss-vs-steps curves (mean over seeds) beside final loss against bytes (one point per run).
"""
from __future__ import annotations

import glob
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _plot  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = os.path.join(ROOT, "tools", "cohort_sim.py")

SEEDS = "0,100,200"   # far apart: seed s uses data streams s + rank
DEMO = []             # the demo model: train_charlm's defaults
BIG = ["--d-model", "256", "--heads", "8", "--layers", "6"]   # 4.8M params, ~10x the demo
BIG_FAST = ["--eval-chunk", "32", "--onehot"]   # the 4.8M model's sim options on a GPU (same numbers)


def base_methods(steps: int) -> List[str]:
    return ["allreduce", "sync-k1", "localsgd-k4", "localsgd-k16", "localsgd-k64",
            f"postlocal-w{steps // 8}-k16", "one-rank"]


def diloco_methods(h: int, tuned: bool, defaults: bool = True) -> List[str]:
    """Library defaults, the former defaults (the paper's), and a small outer lr x momentum grid.

    A grid point whose outer optimizer equals ``DiLoCo()`` is marked as the library default in
    the report.
    """
    out = ([f"diloco-h{h}"] if defaults else []) + [f"diloco-h{h}-paper"]
    if tuned:
        out += [f"diloco-h{h}-lr1.0-m0", f"diloco-h{h}-lr0.7-m0.5", f"diloco-h{h}-lr0.5-m0.8",
                f"diloco-h{h}-lr1.4-m0", f"diloco-h{h}-lr1.0-m0.3", f"diloco-h{h}-lr0.7-m0.5-ow8"]
    return out


DIAGNOSTIC_H64 = ["diloco-h64-lr0.2-m0.9", "diloco-h64-lr0.7-m0.9-ow8", "diloco-h64-paper-wd0",
                  "diloco-h64-w128-paper"]


def cells(plan: str) -> List[Dict]:
    """Named plans; each cell: tag, sim arguments."""
    out = []

    def cell(tag, model, ranks, steps, methods, extra=()):
        every = 64 if steps <= 1024 else (128 if steps <= 4096 else 256)
        out.append({"tag": tag, "argv": [*model, "--ranks", str(ranks), "--steps", str(steps),
                                         "--seeds", SEEDS, "--eval-every", str(every),
                                         "--methods", ",".join(methods), *extra]})

    if plan in ("demo2", "all"):
        for steps in (1024, 4096, 16384):
            grid = base_methods(steps) + diloco_methods(64, True, False) + DIAGNOSTIC_H64
            other = diloco_methods(16, True, False) + diloco_methods(256, True, False)
            if steps == 16384:   # the longest cell in two processes that run side by side
                cell(f"demo-r2-s{steps}-a", DEMO, 2, steps, grid)
                cell(f"demo-r2-s{steps}-b", DEMO, 2, steps, other)
            else:
                cell(f"demo-r2-s{steps}", DEMO, 2, steps, grid + other)
        cell("diag-constlr-r2-s1024", DEMO, 2, 1024, ["allreduce", "diloco-h64-paper", "diloco-h64-lr1.0-m0",
                                                      "one-rank"], ["--lr-floor", "1.0"])
    if plan == "final":   # the cells that test the targets with the library's defaults
        keep = ["allreduce", "localsgd-k16", "diloco-h64", "diloco-h256", "one-rank", "diloco-h64-paper"]
        for i, seed in enumerate(SEEDS.split(",")):   # one process per seed: they run side by side
            cell(f"demo-r2-s16384-p{i}", DEMO, 2, 16384, keep, ["--seeds", seed])
        cell("demo-r2-s4096", DEMO, 2, 4096, base_methods(4096) + ["diloco-h16", "diloco-h64", "diloco-h256",
                                                                   "diloco-h64-paper"])
        cell("demo-r4-s1024", DEMO, 4, 1024, ["allreduce", "localsgd-k16", "diloco-h64", "diloco-h64-paper",
                                              "one-rank"])
        cell("demo-r4-s4096", DEMO, 4, 4096, ["allreduce", "localsgd-k16", "diloco-h64", "one-rank"])
    if plan == "long":   # issue 14's missing cells at the longest budget, one process per seed
        r2 = ["allreduce", "localsgd-k16", "diloco-h64", "diloco-h256", "one-rank", "diloco-h64-paper"]
        # 4 ranks: the target rows, plus two remedies as extra rows (the targets stay K=16 / H=64):
        # K halved so the cohort sees as many samples between syncs as K=16 at 2 ranks, and a
        # larger outer lr for M=4 (the DiLoCo scaling-law study: the best outer lr grows with M).
        r4 = ["allreduce", "localsgd-k16", "diloco-h64", "one-rank", "localsgd-k8", "diloco-h64-lr1.0-m0.5-ow8"]
        big = ["allreduce", "localsgd-k16", "diloco-h64", "one-rank"]
        for i, seed in enumerate(SEEDS.split(",")):
            cell(f"demo-r2-s16384-p{i}", DEMO, 2, 16384, r2, ["--seeds", seed])
            cell(f"demo-r4-s16384-p{i}", DEMO, 4, 16384, r4, ["--seeds", seed])
            cell(f"big-r2-s16384-p{i}", BIG, 2, 16384, big, ["--seeds", seed, "--eval-chunk", "8"])
    if plan == "big16k":   # the 4.8M model to the end of 16k steps: one process, 3 seeds (~8 min on an H200)
        cell("big-r2-s16384", BIG, 2, 16384, ["allreduce", "localsgd-k16", "diloco-h64"], BIG_FAST)
    # 16k steps on the whole stdlib (~28 MB of training text: 2-4 passes over it, not 37-74).
    # One cell at a time: cells side by side on one GPU ran 3-7x slower each (2.2-3.4 min alone).
    wide = ["--corpus-mb", "40", "--eval-every", "512"]

    def wide_at(steps):   # the whole stdlib at any budget: the sim's default eval spacing below 16k
        return wide if steps == 16384 else wide[:2]

    if plan == "wide16k":
        cell("wide-r2-s16384", DEMO, 2, 16384, ["allreduce", "localsgd-k16", "diloco-h64", "one-rank"], wide)
        cell("wide-r4-s16384", DEMO, 4, 16384, ["allreduce", "localsgd-k16", "diloco-h64", "diloco-h256",
                                                "one-rank"], wide)
        # remedies for 4 ranks: as many samples between syncs as K=16 / H=64 at 2 ranks, a larger outer lr
        cell("wide-r4-s16384-b", DEMO, 4, 16384, ["localsgd-k8", "diloco-h32", "diloco-h64-lr1.0-m0.5-ow8"], wide)
    if plan == "wide16k-grid":   # every method; ran 2 cells side by side and was cut at 8192 / 5120 steps
        grid = base_methods(16384) + ["diloco-h16", "diloco-h64", "diloco-h256", "diloco-h64-lr1.0-m0"]
        cell("wide-r2-s16384", DEMO, 2, 16384, grid, wide)
        cell("wide-r4-s16384", DEMO, 4, 16384, grid, wide)
    if plan == "big16k-wide":   # the 4.8M model on the whole stdlib; its one-rank floor on the 2 MB
        # corpus too (-b: merges with big16k's cell)
        cell("bigwide-r2-s16384", BIG, 2, 16384, ["allreduce", "localsgd-k16", "diloco-h64"], wide + BIG_FAST)
        cell("bigwide-r2-s16384-b", BIG, 2, 16384, ["one-rank"], wide + BIG_FAST)
        cell("big-r2-s16384-b", BIG, 2, 16384, ["one-rank"], BIG_FAST)
    if plan == "wide16k-r4":   # the 4-rank misses above: more seeds for the outer-lr remedy, K=1 (is the
        # gap the sync period at all?), and the 4.8M model at 4 ranks, one seed per process (~7 min each)
        cell("wide-r4-s16384-p3", DEMO, 4, 16384, ["allreduce", "localsgd-k16", "diloco-h64",
                                                   "diloco-h64-lr1.0-m0.5-ow8", "sync-k1"],
             wide + ["--seeds", "300,400,500"])
        for i, seed in enumerate(SEEDS.split(",")):
            cell(f"bigwide-r4-s16384-p{i}", BIG, 4, 16384, ["allreduce", "localsgd-k16", "diloco-h64",
                                                            "diloco-h64-lr1.0-m0.5-ow8"],
                 wide + BIG_FAST + ["--seeds", seed])
    if plan == "wide16k-lr":   # the 4-rank K=16 miss: is it the inner lr? Each method at 1x, 1.41x and 2x
        # AdamW's lr (all-reduce too, so the comparison is best against best), and averaging the
        # inner first moments at the syncs. Seeds 0-200: paired with wide16k's cell.
        cell("wide-r4-s16384-lr", DEMO, 4, 16384,
             ["allreduce", "allreduce-lrx1.41", "allreduce-lrx2", "localsgd-k16", "localsgd-k16-lrx1.41",
              "localsgd-k16-lrx2", "localsgd-k16-avgm", "diloco-h64-lrx1.41"], wide)
        # averaging the inner moments (first, or both) at the syncs, on three more seeds, and at K=1
        cell("wide-r4-s16384-mom", DEMO, 4, 16384, ["allreduce", "localsgd-k16", "localsgd-k16-avgm",
                                                    "localsgd-k16-avgmv", "sync-k1-avgm"],
             wide + ["--seeds", "300,400,500"])
        cell("wide-r4-s16384-mom0", DEMO, 4, 16384, ["localsgd-k16-avgmv", "sync-k1-avgm"], wide)
        # the clipping: a quarter batch's gradient is longer than the full batch's, so clip 1.0 bites more
        cell("wide-r4-s16384-clip", DEMO, 4, 16384, ["allreduce", "allreduce-clip0", "sync-k1", "sync-k1-clip0",
                                                     "localsgd-k16-clip0", "localsgd-k16-clip2"], wide)
    if plan == "wide16k-vc":   # the K=1 half of the 4-rank gap: each rank's AdamW second moment sums the
        # squares of a quarter batch's gradients, noisier than all-reduce's; -avgmvc averages both moments at
        # the sync and takes that excess out. And the clipping cell again, with weight decay this time.
        cell("wide-r4-s16384-vc", DEMO, 4, 16384, ["allreduce", "localsgd-k16", "localsgd-k16-avgmvc",
                                                   "sync-k1-avgmvc"], wide + ["--seeds", "0,100,200,300,400,500"])
        cell("wide-r4-s16384-clipwd", DEMO, 4, 16384, ["allreduce", "allreduce-clip0", "sync-k1-clip0",
                                                       "localsgd-k16-clip0", "diloco-h64-avgmvc"], wide)
        # where the target already held: does it cost anything at 2 ranks?
        cell("wide-r2-s16384-vc", DEMO, 2, 16384, ["allreduce", "localsgd-k16", "localsgd-k16-avgmvc",
                                                   "localsgd-k16-avgmvc-me2"], wide)
    if plan == "wide16k-lvc":   # the same excess taken out of each rank's own second moment at every step,
        # nothing sent (denoise_moments=True); seeds paired with wide16k-vc's cell (its plain K=16 row)
        for i, seeds in enumerate(("0,100,200", "300,400,500")):   # one call of the lent GPU each
            cell(f"wide-r4-s16384-lvc-p{i}", DEMO, 4, 16384, ["allreduce", "localsgd-k16-lvc", "sync-k1-lvc",
                                                             "diloco-h64-lvc"], wide + ["--seeds", seeds])
        # the local correction with the first moments averaged at the sync (2x a plain sync's bytes, not 4x)
        cell("wide-r4-s16384-lvc-b", DEMO, 4, 16384, ["localsgd-k16-avgm-lvc"], wide)
        cell("wide-r2-s16384-lvc", DEMO, 2, 16384, ["allreduce", "localsgd-k16", "localsgd-k16-lvc",
                                                    "localsgd-k16-avgmvc"], wide)
    if plan == "wide16k-r4grid":   # every method of the grid at 4 ranks, 16k, whole stdlib, one cell
        # per lent-GPU call (-a/-b/-c merge); DiLoCo's outer lr x momentum tuned at H=64
        cell("wide-r4-s16384-grid-a", DEMO, 4, 16384, base_methods(16384), wide)
        cell("wide-r4-s16384-grid-b", DEMO, 4, 16384, ["diloco-h16", "diloco-h64", "diloco-h256",
                                                       "diloco-h64-paper"], wide)
        cell("wide-r4-s16384-grid-c", DEMO, 4, 16384, ["diloco-h64-lr1.0-m0", "diloco-h64-lr1.4-m0",
                                                       "diloco-h64-lr0.7-m0.5-ow8", "diloco-h64-lr1.4-m0.5-ow8"],
             wide)
    if plan == "wide-grid":   # the whole grid on one corpus (the whole stdlib) at every budget: 1k and
        # 4k at 2 and 4 ranks, and 16k at 2 ranks (4 ranks, 16k: wide16k-r4grid). DiLoCo's outer step tuned at
        # H=64 around the default for M (then lr 0.7 at 2 ranks, 1.0 at 4; now 1.0 at both); -a/-b/-c merge per budget.
        tuned = {2: ["diloco-h64-lr1.0-m0", "diloco-h64-lr1.4-m0", "diloco-h64-lr1.0-m0.5-ow8",
                     "diloco-h64-lr0.5-m0.5-ow8"],
                 4: ["diloco-h64-lr1.0-m0", "diloco-h64-lr1.4-m0", "diloco-h64-lr0.7-m0.5-ow8",
                     "diloco-h64-lr1.4-m0.5-ow8"]}
        for steps, ranks in ((1024, 2), (1024, 4), (4096, 2), (4096, 4), (16384, 2)):
            tag = f"wide-r{ranks}-s{steps}-grid"
            ev = wide_at(steps)
            cell(f"{tag}-a", DEMO, ranks, steps, base_methods(steps), ev)
            cell(f"{tag}-b", DEMO, ranks, steps, ["diloco-h16", "diloco-h64", "diloco-h256", "diloco-h64-paper"], ev)
            cell(f"{tag}-c", DEMO, ranks, steps, tuned[ranks] + (["localsgd-k16-lvc", "sync-k1-lvc"]
                                                                  if steps == 16384 else []), ev)
    if plan == "wide-grid-lr1":   # the 2-rank default (outer lr 1.0 since it was tuned at H=64) at H=16 and H=256,
        # every budget: the one-rank floor and all-reduce are wide-grid's cells (same seeds, same runs)
        for steps in (1024, 4096, 16384):
            cell(f"wide-r2-s{steps}-lr1", DEMO, 2, steps,
                 ["diloco-h16", "diloco-h256"] + (["diloco-h64"] if steps < 16384 else []), wide_at(steps))
    if plan == "wide16k-tuned-h":   # DiLoCo's outer lr tuned at H=16 and H=256 too (wide16k-r4grid and
        # wide-grid tuned it at H=64): the default (lr 1.0, mu 0.5, warm-up 8) against its lr neighbours at
        # 2 and 4 ranks, and momentum at H=256; and 3 ranks, never measured (default lr 1.0 from M=2)
        cell("wide-r4-s16384-tuned-h", DEMO, 4, 16384, ["diloco-h16-lr0.7-m0.5-ow8", "diloco-h16-lr1.4-m0.5-ow8",
                                                        "diloco-h256-lr0.7-m0.5-ow8", "diloco-h256-lr1.4-m0.5-ow8"],
             wide)
        cell("wide-r2-s16384-tuned-h", DEMO, 2, 16384, ["diloco-h16-lr0.5-m0.5-ow8", "diloco-h16-lr1.4-m0.5-ow8",
                                                        "diloco-h256-lr1.4-m0.5-ow8", "diloco-h256-lr1.0-m0.7-ow8"],
             wide)
        cell("wide-r3-s16384", DEMO, 3, 16384, ["allreduce", "localsgd-k16", "diloco-h64", "one-rank"], wide)
        # the outer momentum at H=256 (mu 0.7 beat the default's 0.5 at 2 ranks above) and at H=16; each with
        # its own all-reduce, since it may run on another GPU than the cells it extends
        cell("wide-r4-s16384-mom-h", DEMO, 4, 16384, ["allreduce", "diloco-h256-lr1.0-m0.7-ow8",
                                                      "diloco-h256-lr1.0-m0.9-ow8", "diloco-h16-lr1.0-m0.7-ow8"], wide)
        cell("wide-r2-s16384-mom-h", DEMO, 2, 16384, ["allreduce", "diloco-h256-lr1.0-m0.9-ow8",
                                                      "diloco-h16-lr1.0-m0.3-ow8"], wide)
    if plan == "wide16k-k16v":   # 4 ranks, K=16: the second moment's noise excess taken out at the sync
        # from each rank's own noise (-svc, nothing sent), with the first moments shared (-avgm-svc, 2x a sync's
        # bytes), and sync_moments (-avgmvc, 4x) at every sync against every second sync (-me2, 2.5x)
        cell("wide-r4-s16384-k16v", DEMO, 4, 16384, ["allreduce", "localsgd-k16", "localsgd-k16-avgmvc",
                                                     "localsgd-k16-svc", "localsgd-k16-avgm-svc",
                                                     "localsgd-k16-avgmvc-me2"], wide)
        cell("wide-r4-s16384-k16v-b", DEMO, 4, 16384, ["allreduce", "localsgd-k16", "localsgd-k16-avgmvc",
                                                       "localsgd-k16-svc", "localsgd-k16-avgmvc-me2"],
             wide + ["--seeds", "300,400,500"])
        # per byte: shared moments at a longer K against plain K (K=64 with moments sends what plain K=16
        # sends; K=32 with moments what plain K=8 sends)
        cell("wide-r4-s16384-kbytes", DEMO, 4, 16384, ["allreduce", "localsgd-k64-avgmvc", "localsgd-k32-avgmvc"],
             wide)
        # sync_moments_wire="bf16": the moments at half their bytes, at every sync (2.5x a plain sync's
        # bytes) and at every second one (1.75x); seeds 0-200 pair with wide-r4-s16384-k16v's fp32 rows
        cell("wide-r4-s16384-mbf16", DEMO, 4, 16384, ["allreduce", "localsgd-k16-avgmvc-mbf16",
                                                      "localsgd-k16-avgmvc-me2-mbf16"], wide)
        cell("wide-r4-s16384-mbf16-b", DEMO, 4, 16384, ["allreduce", "localsgd-k16-avgmvc-mbf16",
                                                        "localsgd-k16-avgmvc-me2-mbf16"],
             wide + ["--seeds", "300,400,500"])
        # plain K=16 without sending more: the inner lr falling through each window (-saw, mean lr kept),
        # so the ranks take their smallest steps just before they are averaged
        cell("wide-r4-s16384-saw", DEMO, 4, 16384, ["allreduce", "localsgd-k16", "localsgd-k16-saw0.5",
                                                    "localsgd-k16-saw0.9"], wide)
        # plain K=16's bytes: each rank's noise excess read from its own deviation from the mean params at
        # the sync (-pvc; -pvcm also moves its first moment to its estimate of the mean); K=1 checks the reading
        cell("wide-r4-s16384-pvc", DEMO, 4, 16384, ["allreduce", "localsgd-k16", "localsgd-k16-pvc",
                                                    "localsgd-k16-pvcm", "sync-k1-pvc"], wide)
        cell("wide-r4-s16384-pvc-b", DEMO, 4, 16384, ["allreduce", "localsgd-k16", "localsgd-k16-pvc",
                                                      "localsgd-k16-pvcm"], wide + ["--seeds", "300,400,500"])
        # denoise_moments="sync" (the sim's -pvc) where plain K=16 missed too (3 ranks), where it met (2 ranks),
        # and at the short budgets of 4 ranks
        for ranks in (3, 2):
            cell(f"wide-r{ranks}-s16384-pvc", DEMO, ranks, 16384, ["allreduce", "localsgd-k16", "localsgd-k16-pvc"],
                 wide)
        cell("wide-r3-s16384-pvc-b", DEMO, 3, 16384, ["allreduce", "localsgd-k16", "localsgd-k16-pvc"],
             wide + ["--seeds", "300,400,500"])
        for steps in (1024, 4096):
            cell(f"wide-r4-s{steps}-pvc", DEMO, 4, steps, ["allreduce", "localsgd-k16", "localsgd-k16-pvc"],
                 wide_at(steps))
        # 3 ranks, where plain K=16 also missed (+2.84%): shared moments in bf16
        cell("wide-r3-s16384-mbf16", DEMO, 3, 16384, ["allreduce", "localsgd-k16", "localsgd-k16-avgmvc-mbf16"],
             wide)
    if plan == "auto-big":   # sync_every="auto" against fixed K on the 4.8M model (~5 min on an H200)
        cell("auto-big-r2-s2048", BIG, 2, 2048, ["localsgd-k4", "localsgd-k16", "localsgd-k64", "localsgd-auto"],
             ["--eval-chunk", "8", "--onehot"])
    if plan in ("demo4", "all"):
        for steps in (1024, 4096, 16384):
            cell(f"demo-r4-s{steps}", DEMO, 4, steps, base_methods(steps) + diloco_methods(16, False)
                 + diloco_methods(64, True) + diloco_methods(256, False))
    if plan in ("big", "all"):
        cell("big-r2-s16384", BIG, 2, 16384, ["allreduce", "localsgd-k16", "diloco-h64", "diloco-h64-paper",
                                              "one-rank"], ["--eval-chunk", "8"])
    if plan == "smoke":   # seconds on a CPU: the pipeline end to end
        cell("smoke-r2-s64", ["--d-model", "32", "--layers", "1", "--eval-batches", "2"], 2, 64,
             ["allreduce", "sync-k1", "localsgd-k16", "diloco-h16", "diloco-h16-paper", "one-rank"])
    if not out:
        raise SystemExit(f"convergence study: unknown plan {plan!r}; use demo2, demo4, big, long, big16k, "
                         "wide16k, wide16k-grid, big16k-wide, wide16k-r4, wide16k-lr, wide16k-vc, wide16k-lvc, wide16k-r4grid, wide-grid, wide-grid-lr1, wide16k-tuned-h, wide16k-k16v, auto-big, all or smoke")
    return out


def run_cells(plan: str, out_dir: str, jobs: int, device: str, only: str = None, timeout: float = 7200) -> None:
    todo = [c for c in cells(plan) if not only or c["tag"] in only.split(",")]
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs)) if device == "cpu" else 1
    running: List = []
    t0 = time.perf_counter()
    while todo or running:
        while todo and len(running) < jobs:
            c = todo.pop(0)
            path = os.path.join(out_dir, c["tag"] + ".json")
            cmd = [sys.executable, SIM, *c["argv"], "--device", device, "--threads", str(threads),
                   "--partial", "--json", path]
            log = open(os.path.join(out_dir, c["tag"] + ".log"), "w")
            print(f"[{time.perf_counter() - t0:6.0f} s] start {c['tag']}", flush=True)
            running.append((c, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        time.sleep(2)
        for item in list(running):
            c, proc, log = item
            if proc.poll() is not None or time.perf_counter() - t0 > timeout:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                log.close()
                running.remove(item)
                with open(log.name) as fh:
                    tail = fh.read().strip().splitlines()[-1:] or [""]
                print(f"[{time.perf_counter() - t0:6.0f} s] {c['tag']}: exit {proc.returncode} | {tail[0]}",
                      flush=True)


# ----------------------------------------------------------------------------- report
def _cell_key(tag: str) -> str:
    """Cells split over processes (``-a``/``-b``: by method, ``-p0``, ``-p1``, ...: by seed) merge."""
    head, _, last = tag.rpartition("-")
    return head if last in ("a", "b", "c") or (last[:1] == "p" and last[1:].isdigit()) else tag


def load(out_dir: str) -> Dict[str, Dict]:
    """Cell tag -> {"config", "runs": {method: [per-seed run]}} (split cells merged)."""
    merged: Dict[str, Dict] = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        with open(path) as fh:
            data = json.load(fh)
        if "runs" not in data:
            continue
        key = _cell_key(os.path.basename(path)[:-5])
        cell = merged.setdefault(key, {"config": data["config"], "runs": {}, "partial": False})
        cell["partial"] |= bool(data["config"].get("partial"))
        for r in data["runs"]:
            cell["runs"].setdefault(r["name"], []).append(r)
    return merged


def label(name: str) -> str:
    return name


def _sd(xs: List[float]) -> float:
    """Sample sd; NaN where a run diverged (statistics.stdev raises on a NaN in Python 3.12)."""
    return math.nan if not all(math.isfinite(x) for x in xs) else statistics.stdev(xs)


def summarize(cell: Dict) -> List[Dict]:
    runs = cell["runs"]
    base = {r["seed"]: r["final"]["val_loss"] for r in runs.get("allreduce", [])}
    # the best evaluation of each run: where a long budget overfits, "final" measures memorizing
    best = {name: [min(r["curve"][1:] or r["curve"], key=lambda p: p["val_loss"]) for r in rs]
            for name, rs in runs.items()}
    best_base = {r["seed"]: b["val_loss"] for r, b in zip(runs.get("allreduce", []), best.get("allreduce", []))}
    rows = []
    for name, rs in runs.items():
        finals = [r["final"]["val_loss"] for r in rs]
        gaps = [100.0 * (r["final"]["val_loss"] - base[r["seed"]]) / base[r["seed"]]
                for r in rs if r["seed"] in base]
        rows.append({
            "method": name, "seeds": len(rs), "steps": rs[0]["final"]["step"],
            "mean": statistics.fmean(finals), "std": _sd(finals) if len(finals) > 1 else 0.0,
            "min": min(finals), "max": max(finals),
            "gap_mean": statistics.fmean(gaps) if gaps else None,
            "gap_std": _sd(gaps) if len(gaps) > 1 else None,
            "syncs": rs[0]["syncs"], "bytes": rs[0]["bytes"],
            "param_sum": statistics.fmean(r["final"]["param_sum"] for r in rs),
            "outer": rs[0].get("outer"),
            "best_mean": statistics.fmean(b["val_loss"] for b in best[name]),
            "best_steps": [b["step"] for b in best[name]],
            "best_gap_mean": statistics.fmean(100.0 * (b["val_loss"] - best_base[r["seed"]]) / best_base[r["seed"]]
                                              for r, b in zip(rs, best[name]) if r["seed"] in best_base)
            if best_base else None,
        })
    one = next((r["mean"] for r in rows if r["method"] == "one-rank"), None)
    for r in rows:
        r["vs_one_rank"] = None if one is None else r["mean"] - one
    return rows


def describe(cell: Dict, names=None) -> str:
    """Ranks, params, steps and every seed of the runs in ``names`` (all): merged cells hold several seed sets."""
    cfg = cell["config"]
    seeds = ",".join(str(s) for s in sorted({r["seed"] for n in (names or cell["runs"]) for r in cell["runs"][n]}))
    return f"{cfg['ranks']} ranks, {cfg['params'] / 1e6:.2f}M params, {cfg['steps']} steps, seeds {seeds}"


def markdown(tag: str, cell: Dict, rows: List[Dict]) -> str:
    head = f"**{tag}**: {describe(cell)}" + (" (PARTIAL: the run was cut short)" if cell["partial"] else "")
    ar_bytes = next((r["bytes"] for r in rows if r["method"] == "allreduce"), None)
    lines = [head, "", "| method | final val loss (mean +- sd) | min..max | vs allreduce (mean +- sd, paired) "
             "| vs one rank | syncs | MB per rank | fewer bytes | sum of params | best val loss (mean; at steps) "
             "| best vs allreduce's best |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        gap = "-" if r["gap_mean"] is None else f"{r['gap_mean']:+.2f}% +- {r['gap_std'] or 0:.2f}"
        vs1 = "-" if r["vs_one_rank"] is None else f"{r['vs_one_rank']:+.4f}"
        fewer = f"{ar_bytes / r['bytes']:.0f}x" if ar_bytes and r["bytes"] else "-"
        lines.append(f"| {label(r['method'])} | {r['mean']:.4f} +- {r['std']:.4f} | {r['min']:.4f}..{r['max']:.4f} "
                     f"| {gap} | {vs1} | {r['syncs']} | {r['bytes'] / 1e6:.1f} | {fewer} | {r['param_sum']:.0f} "
                     f"| {r['best_mean']:.4f}; {'/'.join(map(str, r['best_steps']))} "
                     f"| {'-' if r['best_gap_mean'] is None else format(r['best_gap_mean'], '+.2f') + '%'} |")
    return "\n".join(lines)


def plot(tag: str, cell: Dict, path: str, keep=None) -> str:
    plt = _plot.pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    names = [n for n in cell["runs"] if keep is None or n in keep]
    cmap = plt.get_cmap("tab20")
    for i, name in enumerate(names):
        rs = cell["runs"][name]
        n = min(len(r["curve"]) for r in rs)
        steps = [rs[0]["curve"][j]["step"] for j in range(n)]
        mean = [statistics.fmean(r["curve"][j]["val_loss"] for r in rs) for j in range(n)]
        ax1.plot(steps[1:], mean[1:], label=label(name), color=cmap(i % 20), lw=1.2)
        xs = [max(r["final"]["bytes"], 1) / 1e6 for r in rs]
        ax2.scatter(xs, [r["final"]["val_loss"] for r in rs], color=cmap(i % 20), s=14, label=label(name))
    finals = [r["final"]["val_loss"] for n in names for r in cell["runs"][n]]
    finals = [f for f in finals if math.isfinite(f)] or [0.0]   # a diverged run has no point to scale to
    lo, hi = min(finals), max(finals)
    ax1.set_ylim(lo - 0.05, hi + 0.4)
    ax1.set_xlabel("step")
    ax1.set_ylabel("validation loss (nats/byte), mean over seeds")
    ax2.set_xscale("log")
    ax2.set_xlabel("MB handed to collectives per rank (log; one rank plotted at 1e-6)")
    ax2.set_ylabel("final validation loss, one point per run")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=6, ncol=2)
    return _plot.save(fig, path, f"{tag}: {describe(cell, names)}", dpi=100)


def adaptive_verdict(cell: Dict):
    """``localsgd-auto`` against the cell's fixed K (compare_convergence's seed-mean table and verdict)."""
    import compare_convergence as cc
    names = [n for n in cell["runs"] if n.startswith("localsgd-k")] + ["localsgd-auto"]
    runs = [{"name": "auto" if n.endswith("auto") else n, "label": n, "k": "auto" if n.endswith("auto") else 0}
            for n in names]
    seeds = sorted({r["seed"] for r in cell["runs"]["localsgd-auto"]})
    run = {(n, r["seed"]): r for n in names for r in cell["runs"][n]}
    per_seed = [[{"final": run[n, s]["final"], "curve": [{"sync_every": p.get("k")} for p in run[n, s]["curve"]]}
                 for n in names] for s in seeds]
    text, _, verdict = cc.adaptive_summary(runs, per_seed, seeds)
    return text, verdict


def report(out_dir: str, fig_dir: str = None) -> str:
    cells_ = load(out_dir)
    if not cells_:
        raise SystemExit(f"convergence study: no cell results under {out_dir}")
    parts, summary = [], {}
    for tag in sorted(cells_, key=lambda t: (t.split("-")[0] != "demo", t)):
        rows = summarize(cells_[tag])
        summary[tag] = rows
        parts.append(markdown(tag, cells_[tag], rows))
        if "localsgd-auto" in cells_[tag]["runs"]:
            text, verdict = adaptive_verdict(cells_[tag])
            parts += ["", text]
            summary[tag + ":auto"] = verdict
        png = plot(tag, cells_[tag], os.path.join(fig_dir or out_dir, f"study_{tag}.png"))
        if png:
            parts.append(f"\n![{tag}]({os.path.relpath(png, out_dir)})")   # relative to study.md
        parts.append("")
    text = "\n".join(parts)
    with open(os.path.join(out_dir, "study.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(out_dir, "study_summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    print(text)
    return text
