"""Fault campaign: kill, hang, damage and poison a real training job at random, seeded points; count.

    python tools/fault_campaign.py                       # the default campaign (41 trials)
    python tools/fault_campaign.py --kills 6 --stops 2 --damages 3 --nans 1 --worlds 2   # a short one
    python tools/fault_campaign.py --kills 0 --stops 0 --damages 0 --nans 0 --malicious 1 --badloads 1 \
        --bgfails 1 --staletmps 1 --worlds 2 --steps 32                            # checkpoint safety only
    python tools/fault_campaign.py --json faults.json

The job is tools/fault_job.py (the char-LM of examples/train_charlm.py, tiny), run by
``torchrun --standalone --max-restarts N`` with a checkpoint at every consensus point. Trials:

* kill: SIGKILL of a random rank during an inner step (before the forward, before the backward,
  right after the inner AdamW update), during a sync's collective (right after issuing one of its
  all_reduces), or during a checkpoint write (rank 0 after writing part of the file; another rank
  while rank 0 writes). torchrun restarts the job, which resumes from the last checkpoint.
* stop: SIGSTOP of a random rank (after its inner update, or inside a sync's collective) for
  longer than the collective timeout: every other rank must raise ``SyncError`` naming the sync
  within the timeout plus a margin; then the campaign sends SIGCONT and the job restarts and resumes.
* damage: the newest checkpoint truncated, bit-flipped or missing in one rank's copy (each rank
  reads its own copy, as from node-local disks): every rank must refuse it with an error naming
  the file, and the job falls back to the previous checkpoint (it keeps one).
* nan: one rank's loss is NaN at one step: it gets no vote at the next sync, a ``NonFiniteWarning``
  names it, it adopts the others' consensus and the job goes on without a restart.

Checkpoint safety (drawn from a generator of their own, after the others: a seed plans the kinds
above as before):

* malicious: every rank's newest checkpoint is replaced by one whose unpickling would run a shell
  command (it creates a marker file), sealed with a recomputed CRC32: every rank must refuse it
  naming the file, the marker must never appear, and the job falls back to the previous one.
* badload: at a consensus point every rank loads the previous checkpoint rewritten with another
  ``sync_every``: ``ConfigError`` on every rank, and the model and optimizer state (digests) must
  be unchanged; the run goes on bit-exact.
* bgfail: the last checkpoint of the run is written in the background and fails (the writer
  raises ENOSPC on rank 0): every rank must report it at ``flo.shutdown()`` naming the file and
  the cause, the job must exit non-zero, and ``last.pt`` must hold the checkpoint before it.
* staletmp: rank 0 is SIGKILLed inside a checkpoint write: the torn temp file is there at the
  resume and gone after the next save; the resume is bit-exact.

Kill and stop trials run in chains: one torchrun job of C trials with ``--max-restarts C``, attempt
k hosting fault k (C process start-ups instead of 2C). Each trial is judged on its own from the
job's event log: the step its attempt resumed from, the steps redone (work done before the fault
minus the resume step), the digest of the params after the resume and at every later consensus
point against an uninterrupted run with the same seed (bit-exact), and the wall time from the
fault to the resumed state. Every job runs under a deadline; on expiry its whole process tree is
SIGKILLed and its unfinished trials count as hangs.

Output: one line per trial as it is judged (with the ETA), the table, a summary line
``N/M trials recovered, H hangs, max steps lost L``, and ``--json``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tools", "fault_job.py")

KILL_PHASES = ("forward", "backward", "optimizer", "collective", "checkpoint")
INNER_PHASES = ("forward", "backward", "optimizer")   # "during an inner step"
STOP_PHASES = ("optimizer", "collective")
DAMAGES = ("truncate", "flip", "missing")
DETECT_MARGIN_S = 20.0   # SyncError must come within the collective timeout plus this (a loaded host)


# ----------------------------------------------------------------------------- trials
@dataclasses.dataclass
class Trial:
    id: int
    kind: str                 # kill | stop | damage | nan
    world: int
    rank: int
    step: int                 # 0-based step of the fault (damage: the step of the damaged checkpoint)
    phase: str                # kill/stop: where; damage: truncate|flip|missing; nan: "loss"
    attempt: int = 0          # the attempt of its job that hosts it
    detail: Dict[str, Any] = dataclasses.field(default_factory=dict)
    # results
    recovered: bool = False
    hang: bool = False
    resumed_from: Optional[int] = None
    steps_lost: Optional[int] = None
    exact: Optional[bool] = None
    checked_steps: List[int] = dataclasses.field(default_factory=list)
    loss_diff: Optional[float] = None
    recover_s: Optional[float] = None
    detect_s: Optional[float] = None
    note: str = ""

    def fault_spec(self) -> Dict[str, Any]:
        return {"attempt": self.attempt, "kind": self.kind, "rank": self.rank, "step": self.step,
                "phase": self.phase, **self.detail}


@dataclasses.dataclass
class Config:
    steps: int = 88
    sync_every: int = 4
    seed: int = 0
    timeout_s: float = 60.0          # collective timeout of kill/damage/nan jobs
    stop_timeout_s: float = 12.0     # collective timeout of stop chains (a stop lasts longer)
    stall_warning_s: float = 4.0     # stall warning of stop chains (before the timeout)
    snapshot_at: int = 32            # the reference's checkpoints at this step feed the damage trials
    attempt_deadline_s: float = 150.0   # per attempt of a job (start-up on a loaded host included)


def _sync_steps(cfg: Config, lo: int, hi: int) -> List[int]:
    """0-based steps whose opt.step() ends in a sync (and a checkpoint), in [lo, hi)."""
    return [s for s in range(lo, hi) if (s + 1) % cfg.sync_every == 0]


def _chain(cfg: Config, kind: str, world: int, phases: List[str], rng: random.Random, tid: int,
           chain: int, rank: Optional[int] = None) -> List[Trial]:
    """One chain of trials (one per attempt of a torchrun job); ids from ``tid``."""
    K = cfg.sync_every
    trials, prev = [], None
    for attempt, phase in enumerate(phases):
        if phase == "inner":
            phase = rng.choice(INNER_PHASES)
        # Each attempt passes at least one consensus point after its resume before the
        # next fault (resume <= previous fault + 1), so every trial is checked on its own.
        lo = K + 1 if prev is None else prev + K + 2
        candidates = (_sync_steps(cfg, lo, lo + 2 * K) if phase in ("collective", "checkpoint")
                      else list(range(lo, lo + K)))
        step = rng.choice(candidates)
        if step >= cfg.steps - 1:
            raise SystemExit(f"--steps {cfg.steps} is too short for chains of {chain}; raise "
                             f"--steps to {step + 2 * K} or lower --chain")
        detail: Dict[str, Any] = {}
        if phase == "collective":
            detail["call"] = rng.randrange(2)   # the count, or the params' reduce
        if phase == "checkpoint":
            detail["fraction"] = round(rng.uniform(0.05, 0.95), 3)
        who = rng.randrange(world) if rank is None else rank
        trials.append(Trial(tid + attempt, kind, world, who, step, phase, attempt, detail))
        prev = step
    return trials


def plan(cfg: Config, kills: int, stops: int, damages: int, nans: int, worlds: List[int],
         chain: int, seed: int, malicious: int = 0, badloads: int = 0, bgfails: int = 0,
         staletmps: int = 0) -> List[List[Trial]]:
    """Jobs (lists of trials), drawn from ``seed``. Kill, stop and staletmp trials come in chains.

    The checkpoint-safety kinds (malicious, badload, bgfail, staletmp) are drawn from a generator
    of their own and come after the others, so a seed plans the other kinds as before."""
    rng = random.Random(seed)
    K = cfg.sync_every
    # Kills: a third each "during an inner step", "during a collective", "during a checkpoint".
    kinds = [("kill", ("inner", "collective", "checkpoint")[i % 3]) for i in range(kills)]
    kinds += [("stop", STOP_PHASES[i % len(STOP_PHASES)]) for i in range(stops)]
    jobs: List[List[Trial]] = []
    tid = 0
    for kind in ("kill", "stop"):
        mine = [p for k, p in kinds if k == kind]
        rng.shuffle(mine)
        per_world = {w: mine[i::len(worlds)] for i, w in enumerate(worlds)}
        for world, phases in per_world.items():
            for c in range(0, len(phases), chain):
                trials = _chain(cfg, kind, world, phases[c:c + chain], rng, tid, chain)
                tid += len(trials)
                jobs.append(trials)
    # Damage and NaN trials: one launch per world size runs them one after another (--runs):
    # their faults strike at load time or inside a run, not at the process.
    batch: Dict[int, List[Trial]] = {w: [] for w in worlds}
    for i in range(damages):
        world = worlds[i % len(worlds)]
        batch[world].append(Trial(tid, "damage", world, rng.randrange(world), cfg.snapshot_at - 1,
                                  DAMAGES[i % len(DAMAGES)], len(batch[world]), {"draw": rng.random()}))
        tid += 1
    for i in range(nans):
        world = worlds[i % len(worlds)]
        batch[world].append(Trial(tid, "nan", world, rng.randrange(world), rng.randrange(K + 1, cfg.steps - 2 * K),
                                  "loss", len(batch[world])))
        tid += 1
    # Checkpoint safety: a crafted (code-running) newest checkpoint and a refused load join the
    # batches; staletmp trials (rank 0 killed inside a checkpoint write) come in chains; a failed
    # last background write needs a launch of its own (it is judged at the exit).
    rng2 = random.Random(seed * 7919 + 1)
    for i in range(malicious):
        world = worlds[i % len(worlds)]
        batch[world].append(Trial(tid, "malicious", world, -1, cfg.snapshot_at - 1, "sealed pickle",
                                  len(batch[world])))
        tid += 1
    for i in range(badloads):
        world = worlds[i % len(worlds)]
        step = rng2.choice(_sync_steps(cfg, 2 * K, cfg.steps - K))   # prev.pt exists from the 2nd save
        batch[world].append(Trial(tid, "badload", world, -1, step, "another sync_every", len(batch[world])))
        tid += 1
    jobs += [ts for ts in batch.values() if ts]
    for world in worlds:
        mine = ["checkpoint"] * len(range(worlds.index(world), staletmps, len(worlds)))
        for c in range(0, len(mine), chain):
            trials = _chain(cfg, "staletmp", world, mine[c:c + chain], rng2, tid, chain, rank=0)
            tid += len(trials)
            jobs.append(trials)
    last = _sync_steps(cfg, 0, cfg.steps)[-1]
    for i in range(bgfails):
        jobs.append([Trial(tid, "bgfail", worlds[i % len(worlds)], 0, last, "ENOSPC", 0)])
        tid += 1
    return jobs


# ----------------------------------------------------------------------------- running a job
@dataclasses.dataclass
class JobResult:
    rc: Optional[int]
    hang: bool
    wall_s: float
    output: str
    dir: str


def read_events(job_dir: str) -> List[Dict[str, Any]]:
    events = []
    log_dir = os.path.join(job_dir, "log")
    if not os.path.isdir(log_dir):
        return events
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name)) as fh:
            for line in fh:
                try:
                    events.append(json.loads(line))
                except ValueError:   # a line cut by a SIGKILL
                    pass
    events.sort(key=lambda e: e["t"])
    return events


def job_args(cfg: Config, job_dir: str, timeout_s: float, stall_warning_s: Optional[float] = None,
             load_dir: Optional[str] = None, snapshot_at: int = -1) -> List[str]:
    args = ["--dir", job_dir, "--steps", str(cfg.steps), "--sync-every", str(cfg.sync_every),
            "--seed", str(cfg.seed), "--timeout", str(timeout_s), "--snapshot-at", str(snapshot_at)]
    if stall_warning_s is not None:
        args += ["--stall-warning", str(stall_warning_s)]
    if load_dir is not None:
        args += ["--load-dir", load_dir]
    return args


def run_torchrun(job_dir: str, world: int, args: List[str], faults: List[Dict[str, Any]],
                 max_restarts: int, deadline_s: float,
                 on_poll: Optional[Callable[[List[Dict[str, Any]]], None]] = None) -> JobResult:
    """One torchrun job; its whole process tree is SIGKILLed if it outlives ``deadline_s``."""
    import psutil

    os.makedirs(job_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", FLODL_FAULT=json.dumps(faults),
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(world), "--max-restarts", str(max_restarts),
           "--monitor-interval", "0.1", JOB, *args]
    out_path = os.path.join(job_dir, "torchrun.out")
    t0 = time.monotonic()
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=job_dir,
                                start_new_session=True)
    seen: Dict[int, "psutil.Process"] = {}   # every process of the tree (workers have their own sessions)
    hang = False
    try:
        root = psutil.Process(proc.pid)
        seen[proc.pid] = root
        while proc.poll() is None:
            try:
                for child in root.children(recursive=True):
                    seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass
            if on_poll is not None:
                on_poll(read_events(job_dir))
            if time.monotonic() - t0 > deadline_s:
                hang = True
                break
            time.sleep(0.1)
    finally:
        for p in seen.values():   # SIGKILL works on stopped processes too
            try:
                if p.is_running():
                    p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=30)
    with open(out_path) as fh:
        output = fh.read()
    return JobResult(None if hang else proc.returncode, hang, time.monotonic() - t0, output, job_dir)


class StopHandler:
    """During a stop chain: SIGCONT a stopped rank once every other rank raised (or the bound passed)."""

    def __init__(self, trials: List[Trial], timeout_s: float):
        self.trials = {t.attempt: t for t in trials}
        self.bound = timeout_s + DETECT_MARGIN_S
        self.done: set = set()

    def __call__(self, events: List[Dict[str, Any]]) -> None:
        for e in events:
            if e["event"] != "fault" or e.get("kind") != "stop" or e["attempt"] in self.done:
                continue
            trial = self.trials.get(e["attempt"])
            survivors = [r for r in range(trial.world) if r != trial.rank] if trial else []
            raised = {x["rank"] for x in events if x.get("attempt") == e["attempt"]
                      and x["event"] in ("sync_error", "error")}
            if set(survivors) <= raised or time.time() - e["t"] > self.bound:
                try:
                    os.kill(e["pid"], signal.SIGCONT)
                except ProcessLookupError:
                    pass
                self.done.add(e["attempt"])


# ----------------------------------------------------------------------------- the reference
@dataclasses.dataclass
class Reference:
    digests: Dict[int, str]
    final: Dict[str, Any]
    final_loss: float
    dir: str


def load_reference(job_dir: str) -> Reference:
    import torch
    events = read_events(job_dir)
    digests = {e["step"]: e["digest"] for e in events if e["event"] == "params" and e["rank"] == 0}
    done = [e for e in events if e["event"] == "done"]
    if not done:
        raise RuntimeError(f"the reference run in {job_dir} did not finish")
    final = torch.load(os.path.join(job_dir, "final", "rank0.pt"))
    return Reference(digests, final, done[0]["final_loss"], job_dir)


def reference_job(cfg: Config, work: str, world: int) -> Tuple[Reference, JobResult]:
    job_dir = os.path.join(work, f"reference_w{world}")
    res = run_torchrun(job_dir, world, job_args(cfg, job_dir, cfg.timeout_s, snapshot_at=cfg.snapshot_at),
                       [], 0, cfg.attempt_deadline_s)
    if res.rc != 0:
        raise RuntimeError(f"the uninterrupted {world}-rank run failed (rc {res.rc}):\n{res.output[-4000:]}")
    return load_reference(job_dir), res


# ----------------------------------------------------------------------------- judging
def _completed(trial: Trial) -> int:
    """Steps whose work was done when the fault hit (the inner update of the step included or not)."""
    return trial.step if trial.phase in ("forward", "backward") else trial.step + 1


def _final_equal(job_dir: str, ref: Reference, world: int) -> Optional[bool]:
    import torch
    finals = []
    for r in range(world):
        path = os.path.join(job_dir, "final", f"rank{r}.pt")
        if not os.path.exists(path):
            return None
        finals.append(torch.load(path))
    return all(f.keys() == ref.final.keys() and all(torch.equal(f[k], ref.final[k]) for k in f) for f in finals)


def _check_digests(events, attempt: int, world: int, ref: Reference, upto: Optional[int] = None):
    """Steps an attempt logged params at (resume + consensus points) and whether all match the reference."""
    mine = [e for e in events if e["event"] == "params" and e["attempt"] == attempt]
    steps = sorted({e["step"] for e in mine if upto is None or e["step"] <= upto})
    ok = all(e["digest"] == ref.digests.get(e["step"]) for e in mine if e["step"] in steps)
    return steps, ok and bool(steps)


def judge_chain(trials: List[Trial], res: JobResult, ref: Reference, cfg: Config) -> None:
    events = read_events(res.dir)
    for i, t in enumerate(trials):
        faults = [e for e in events if e["event"] == "fault" and e["attempt"] == t.attempt]
        if not faults:
            t.hang = res.hang
            t.note = "the fault never fired (an earlier trial of the chain failed?)" if not res.hang else \
                "job deadline passed before the fault"
            continue
        f = faults[0]
        if t.kind == "stop":
            _judge_stop(t, f, events, res, cfg)
        nxt = t.attempt + 1
        resumes = [e for e in events if e["event"] == "resume" and e["attempt"] == nxt]
        if len(resumes) < t.world:
            t.hang = t.hang or res.hang
            t.note = (t.note + "; " if t.note else "") + "no resumed attempt"
            continue
        starts = {e["start"] for e in resumes}
        if len(starts) != 1:
            t.note = f"ranks resumed from different steps {sorted(starts)}"
            continue
        t.resumed_from = starts.pop()
        t.steps_lost = _completed(t) - t.resumed_from
        t.recover_s = max(e["t"] for e in resumes) - f["t"]
        last = i == len(trials) - 1
        t.checked_steps, t.exact = _check_digests(events, nxt, t.world, ref)
        if last:
            final_ok = res.rc == 0 and _final_equal(res.dir, ref, t.world)
            t.exact = bool(t.exact and final_ok)
            if not final_ok:
                t.note = (t.note + "; " if t.note else "") + f"final state differs or job failed (rc {res.rc})"
        ok_lost = 0 <= t.steps_lost <= cfg.sync_every
        if not ok_lost:
            t.note = (t.note + "; " if t.note else "") + f"lost {t.steps_lost} > K"
        stop_ok = t.kind != "stop" or t.detail.get("syncerror_ok", False)
        if t.kind == "staletmp":
            stop_ok = _judge_staletmp(t, events, nxt)
        t.recovered = bool(t.exact) and ok_lost and stop_ok and not t.hang


def _judge_staletmp(t: Trial, events, attempt: int) -> bool:
    """The killed write's temp file is there at the resume and gone after the next save."""
    temps = [e for e in events if e["event"] == "temps" and e["attempt"] == attempt]
    at_resume = [e for e in temps if e["at"] == "resume"]
    saves = [e for e in temps if e["at"] == "save"]
    torn = bool(at_resume and at_resume[0]["names"])
    cleaned = bool(saves) and saves[0]["names"] == []
    t.detail.update(torn_temp_at_resume=torn, cleaned_at_next_save=cleaned)
    if not torn:
        t.note = (t.note + "; " if t.note else "") + "no temp file left by the kill (nothing to clean)"
    elif not cleaned:
        t.note = (t.note + "; " if t.note else "") + f"stale temp NOT removed by the next save {saves[:1]}"
    return torn and cleaned


def _judge_stop(t: Trial, fault: Dict[str, Any], events, res: JobResult, cfg: Config) -> None:
    """Every other rank raised SyncError naming the sync, within the timeout plus the margin."""
    expected = t.step // cfg.sync_every + 1
    errs = {e["rank"]: e for e in events if e["event"] == "sync_error" and e["attempt"] == t.attempt}
    survivors = [r for r in range(t.world) if r != t.rank]
    missing = [r for r in survivors if r not in errs]
    bound = cfg.stop_timeout_s + DETECT_MARGIN_S
    if missing:
        t.hang = True
        t.note = f"rank(s) {missing} raised no SyncError within {bound:.0f}s of the stop"
        return
    t.detect_s = max(errs[r]["t"] - fault["t"] for r in survivors)
    named = all(f"sync #{expected} failed" in errs[r]["message"] for r in survivors)
    warned = any(e["event"] == "log" and e["attempt"] == t.attempt and f"sync #{expected}" in e["message"]
                 and re.search(rf"ranks \[{t.rank}\] have not arrived", e["message"]) for e in events)
    t.detail["stall_warning_named_it"] = warned
    if t.detect_s > bound:
        t.hang = True
        t.note = f"SyncError after {t.detect_s:.1f}s > timeout {cfg.stop_timeout_s:g}s + {DETECT_MARGIN_S:g}s"
    elif not named:
        t.note = f"SyncError did not name sync #{expected}"
    t.detail["syncerror_ok"] = named and not t.hang


def damage_file(path: str, how: str, draw: float) -> str:
    """Damage ``path`` in place; ``draw`` in [0, 1) picks the spot. Returns what was done."""
    size = os.path.getsize(path)
    if how == "missing":
        os.unlink(path)
        return "deleted"
    if how == "truncate":
        n = int(draw * size)
        with open(path, "r+b") as fh:
            fh.truncate(n)
        return f"cut to {n} of {size} bytes"
    pos, bit = int(draw * size), int(draw * 1e6) % 8
    with open(path, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)[0]
        fh.seek(pos)
        fh.write(bytes([b ^ (1 << bit)]))
    return f"bit {bit} of byte {pos} of {size} flipped"


def prepare_damage(t: Trial, ref: Reference, job_dir: str) -> None:
    """Every rank its own copy of the reference's snapshot; rank ``t.rank``'s newest one damaged."""
    template = os.path.join(job_dir, "view", "rank{rank}")
    for r in range(t.world):
        view = template.format(rank=r)
        os.makedirs(view, exist_ok=True)
        for name in ("last.pt", "prev.pt"):
            shutil.copyfile(os.path.join(ref.dir, "snapshot", name), os.path.join(view, name))
    target = os.path.join(template.format(rank=t.rank), "last.pt")
    t.detail["damage"] = damage_file(target, t.phase, t.detail["draw"])
    t.detail["file"] = target


class _RunsCode:
    """Unpickling this runs a shell command that creates ``marker`` (a crafted checkpoint's payload)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        import shlex
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def prepare_malicious(t: Trial, ref: Reference, job_dir: str) -> None:
    """Every rank's newest checkpoint replaced by one whose unpickling runs code, sealed with a
    recomputed CRC32 (anyone can): only a loader that runs no code from the file refuses it."""
    import torch
    sys.path.insert(0, ROOT)
    from flodl_opt.checkpoint import atomic_save
    template = os.path.join(job_dir, "view", "rank{rank}")
    marker = os.path.join(job_dir, "code_ran")
    payload = torch.load(os.path.join(ref.dir, "snapshot", "last.pt"), map_location="cpu", weights_only=True)
    payload["ranks"][0]["extra"] = dict(payload["ranks"][0]["extra"], x=_RunsCode(marker))
    for r in range(t.world):
        view = template.format(rank=r)
        os.makedirs(view, exist_ok=True)
        shutil.copyfile(os.path.join(ref.dir, "snapshot", "prev.pt"), os.path.join(view, "prev.pt"))
        atomic_save(payload, os.path.join(view, "last.pt"))
    t.detail.update(file=os.path.join(template.format(rank=0), "last.pt"), marker=marker)


def judge_malicious(t: Trial, res: JobResult, ref: Reference, cfg: Config) -> None:
    events = read_events(res.dir)
    refusals = [e for e in events if e["event"] == "refused" and e["path"].endswith("last.pt")]
    everyone = f"rank(s) {list(range(t.world))}"
    refused = len({e["rank"] for e in refusals}) == t.world and all(
        everyone in e["message"] and "is refused" in e["message"] for e in refusals)
    ran = os.path.exists(t.detail["marker"])
    t.detail.update(refused=refused, code_ran=ran)
    if res.hang:
        t.hang, t.note = True, "job deadline passed"
        return
    _judge_resume(t, events, res, ref, cfg)
    t.note = ", ".join(k for k, v in (("its code RAN", ran), ("not refused on every rank", not refused),
                                      ("did not fall back to prev.pt and finish bit-exact",
                                       not (t.exact and t.resumed_from == cfg.snapshot_at - cfg.sync_every)))
                       if v)
    t.recovered = refused and not ran and bool(t.exact) and t.resumed_from == cfg.snapshot_at - cfg.sync_every


def judge_badload(t: Trial, res: JobResult, ref: Reference, cfg: Config) -> None:
    """Every rank got ConfigError, its model and optimizer state unchanged; the job went on bit-exact."""
    events = read_events(res.dir)
    if res.hang:
        t.hang, t.note = True, "job deadline passed"
        return
    loads = {e["rank"]: e for e in events if e["event"] == "badload" and e["attempt"] == t.attempt}
    refused = len(loads) == t.world and all(e["refused"] for e in loads.values())
    same = len(loads) == t.world and all(e["same"] for e in loads.values())
    t.checked_steps, t.exact = _check_digests(events, t.attempt, t.world, ref)
    t.exact = bool(t.exact and res.rc == 0 and _final_equal(res.dir, ref, t.world))
    t.steps_lost = 0
    t.detail.update(refused=refused, untouched=same)
    t.note = ", ".join(k for k, v in (("not refused on every rank", not refused),
                                      ("the refused load WROTE state", not same),
                                      ("the run diverged from the uninterrupted one", not t.exact)) if v)
    t.recovered = refused and same and bool(t.exact)


def judge_bgfail(t: Trial, res: JobResult, ref: Reference, cfg: Config) -> None:
    """The failed last background write is reported on every rank and the job fails (non-zero)."""
    import torch
    events = read_events(res.dir)
    if res.hang:
        t.hang, t.note = True, "job deadline passed"
        return
    target = os.path.join(res.dir, "ckpt", "last.pt")
    exits: List[Dict[str, Any]] = []
    if os.path.exists(os.path.join(res.dir, "exit.jsonl")):
        with open(os.path.join(res.dir, "exit.jsonl")) as fh:
            exits = [json.loads(line) for line in fh if line.strip()]
    errs = {e["rank"]: e for e in exits if e["event"] == "shutdown_error"}
    reported = len(errs) == t.world and all(target in e["message"] and "No space left on device" in e["message"]
                                            for e in errs.values())
    failed = res.rc not in (0, None)
    t.checked_steps, t.exact = _check_digests(events, 0, t.world, ref)   # the training itself went on
    kept = None
    with contextlib.suppress(Exception):
        kept = torch.load(target, map_location="cpu", weights_only=True)["ranks"][0]["extra"]["step"]
    previous_ok = kept == t.step + 1 - cfg.sync_every
    t.detail.update(reported_on=sorted(errs), job_rc=res.rc, kept_step=kept)
    t.note = ", ".join(k for k, v in (("NOT reported on every rank", not reported), ("job exited 0", not failed),
                                      (f"last.pt holds step {kept}", not previous_ok),
                                      ("training diverged", not t.exact)) if v)
    t.recovered = reported and failed and previous_ok and bool(t.exact)


def judge_damage(t: Trial, res: JobResult, ref: Reference, cfg: Config) -> None:
    events = read_events(res.dir)
    refusals = [e for e in events if e["event"] == "refused" and e["path"].endswith("last.pt")]
    target = t.detail["file"]
    named = len({e["rank"] for e in refusals}) == t.world and all(
        target in e["message"] and f"rank(s) [{t.rank}]" in e["message"] for e in refusals)
    t.detail["detected"] = named
    if res.hang:
        t.hang, t.note = True, "job deadline passed"
        return
    _judge_resume(t, events, res, ref, cfg)
    if not named:
        t.note = "not refused on every rank with the file named" if refusals else "damage NOT detected"
    t.recovered = named and bool(t.exact) and t.resumed_from == cfg.snapshot_at - cfg.sync_every


def _judge_resume(t: Trial, events: list, res: JobResult, ref: Reference, cfg: Config) -> None:
    """Where every rank resumed (one step for all, or nothing set), how much was lost, and whether the
    run then ended bit-exact against the reference."""
    resumes = [e for e in events if e["event"] == "resume"]
    starts = {e["start"] for e in resumes}
    if len(resumes) == t.world and len(starts) == 1:
        t.resumed_from = starts.pop()
        t.steps_lost = cfg.snapshot_at - t.resumed_from
        t.recover_s = max(e["load_s"] for e in resumes)
    t.checked_steps, t.exact = _check_digests(events, t.attempt, t.world, ref)
    t.exact = bool(t.exact and res.rc == 0 and _final_equal(res.dir, ref, t.world))


def judge_nan(t: Trial, res: JobResult, ref: Reference, cfg: Config) -> None:
    import torch
    events = read_events(res.dir)
    sync = t.step // cfg.sync_every + 1
    warned = any(e["event"] == "warning" and e["rank"] == t.rank and e["category"] == "NonFiniteWarning"
                 and f"rank {t.rank}'s params or float buffers were NaN/Inf at sync #{sync}" in e["message"]
                 for e in events)
    done = [e for e in events if e["event"] == "done"]
    attempts = {e["attempt"] for e in events}
    if res.hang:
        t.hang, t.note = True, "job deadline passed"
        return
    finals = [torch.load(os.path.join(res.dir, "final", f"rank{r}.pt"))
              for r in range(t.world) if os.path.exists(os.path.join(res.dir, "final", f"rank{r}.pt"))]
    same = len(finals) == t.world and all(torch.equal(f[k], finals[0][k]) for f in finals for k in f)
    finite = bool(finals) and all(bool(torch.isfinite(v).all()) for v in finals[0].values() if v.is_floating_point())
    went_on = res.rc == 0 and len(done) == t.world and attempts == {t.attempt}
    adopted = (t.step // cfg.sync_every + 1) * cfg.sync_every - 1   # the step whose sync gave no vote
    later = [v for e in done if e["rank"] == t.rank for s, v in e["losses"].items() if int(s) > adopted]
    trains_on = bool(later) and all(v == v and abs(v) != float("inf") for v in later)
    t.resumed_from = None
    t.steps_lost = cfg.sync_every   # that rank's work of one sync window got no vote
    if done:
        t.loss_diff = done[0]["final_loss"] - ref.final_loss
    t.detail.update(warned=warned, ranks_identical=same, finite=finite, trains_on=trains_on)
    t.recovered = warned and same and finite and went_on and trains_on
    if not t.recovered:
        t.note = ", ".join(k for k, v in (("no warning naming it", not warned), ("ranks differ", not same),
                                          ("non-finite", not finite), ("job stopped", not went_on),
                                          ("rank did not train on", not trains_on)) if v)


# ----------------------------------------------------------------------------- the campaign
def run_job(trials: List[Trial], refs: Dict[int, Reference], cfg: Config, work: str,
            runner: Optional[Callable] = None) -> JobResult:
    """Run one job (a chain of kill/stop/staletmp trials, a batch of load-time trials, or a bgfail
    trial) and judge its trials."""
    first = trials[0]
    job_dir = os.path.join(work, f"job{first.id:03d}_{first.kind}_w{first.world}")
    ref = refs[first.world]
    if first.kind == "bgfail":
        args = job_args(cfg, job_dir, cfg.timeout_s) + ["--background"]
        res = run_torchrun(job_dir, first.world, args, [first.fault_spec()], 0, cfg.attempt_deadline_s)
        judge_bgfail(first, res, ref, cfg)
        return res
    if first.kind in ("kill", "stop", "staletmp"):
        stop = any(t.kind == "stop" for t in trials)
        timeout = cfg.stop_timeout_s if stop else cfg.timeout_s
        args = job_args(cfg, job_dir, timeout, cfg.stall_warning_s if stop else None)
        handler = StopHandler(trials, timeout) if stop else None
        stops = sum(t.kind == "stop" for t in trials)
        deadline = cfg.attempt_deadline_s * (len(trials) + 1) + (timeout + DETECT_MARGIN_S) * stops
        res = run_torchrun(job_dir, first.world, args, [t.fault_spec() for t in trials], len(trials),
                           deadline, handler)
        judge_chain(trials, res, ref, cfg)
        return res
    # A batch of damage / NaN trials, one run each.
    n = len(trials)
    run_dir = (lambda k: job_dir) if n == 1 else (lambda k: os.path.join(job_dir, f"run{k}"))
    for t in trials:
        if t.kind == "damage":
            prepare_damage(t, ref, run_dir(t.attempt))
        if t.kind == "malicious":
            prepare_malicious(t, ref, run_dir(t.attempt))
    load = os.path.join(job_dir, "view", "rank{rank}") if n == 1 else \
        os.path.join(job_dir, "run{run}", "view", "rank{rank}")   # no view: a fresh start (NaN runs)
    args = job_args(cfg, job_dir, cfg.timeout_s, load_dir=load) + ["--runs", str(n)]
    faults = [t.fault_spec() for t in trials if t.kind == "nan"]
    faults += [dict(t.fault_spec(), rank=r) for t in trials if t.kind == "badload" for r in range(t.world)]
    res = (runner or _torchrun_single)(job_dir, first.world, args, faults, cfg.attempt_deadline_s * n)
    for t in trials:
        mine = dataclasses.replace(res, dir=run_dir(t.attempt))
        {"damage": judge_damage, "nan": judge_nan, "malicious": judge_malicious,
         "badload": judge_badload}[t.kind](t, mine, ref, cfg)
    return res


def _torchrun_single(job_dir, world, args, faults, deadline_s) -> JobResult:
    return run_torchrun(job_dir, world, args, faults, 0, deadline_s)


def _fmt(v, spec="") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return format(v, spec)


def describe(t: Trial) -> str:
    where = {"forward": "inner step: before forward", "backward": "inner step: before backward",
             "optimizer": "inner step: after AdamW update", "collective": f"sync collective #{t.detail.get('call', 0)}",
             "checkpoint": "checkpoint write" + (f" ({t.detail.get('fraction', 0):.0%} written)" if t.rank == 0
                                                 else " (rank 0 writing)"),
             "loss": "NaN loss"}.get(t.phase, t.detail.get("damage", t.phase))
    where = {"staletmp": f"checkpoint write ({t.detail.get('fraction', 0):.0%} written), then the next save",
             "malicious": "newest checkpoint runs code (sealed), every rank",
             "badload": "load of prev.pt with another sync_every",
             "bgfail": "last background save: disk full (ENOSPC)"}.get(t.kind, where)
    if t.kind == "damage":
        where = f"{t.phase}: {t.detail.get('damage', '')}"
    return where


HEADER = (f"{'#':>3} {'kind':6} {'ranks':>5} {'rank':>4} {'step':>4}  {'where':44} {'ok':>3} {'from':>4} "
          f"{'lost':>4} {'exact':>5} {'recover_s':>9} {'detect_s':>8}  note")


def row(t: Trial) -> str:
    exact = _fmt(t.exact) if t.kind != "nan" else f"d{t.loss_diff:+.1e}" if t.loss_diff is not None else "-"
    note = t.note
    if t.kind == "stop" and "stall_warning_named_it" in t.detail and not note:
        note = ("stall warning named it" if t.detail["stall_warning_named_it"] else
                "no stall warning (it had entered the sync)" if t.phase == "collective" else "no stall warning")
    if t.kind == "damage" and not note:
        note = "refused on every rank, file named; fell back to prev.pt"
    if t.kind == "nan" and not note:
        note = "no vote, warned, went on"
    if not note:
        note = {"staletmp": "torn temp removed by the next save", "malicious": "refused, no code ran, fell back",
                "badload": "ConfigError everywhere, nothing written", "bgfail": "reported on every rank, exit non-zero"
                }.get(t.kind, note)
    return (f"{t.id:>3} {t.kind:6} {t.world:>5} {t.rank:>4} {t.step:>4}  {describe(t)[:44]:44} "
            f"{_fmt(t.recovered):>3} {_fmt(t.resumed_from):>4} {_fmt(t.steps_lost):>4} {exact:>5} "
            f"{_fmt(t.recover_s, '.1f'):>9} {_fmt(t.detect_s, '.1f'):>8}  {note}")


def summarize(trials: List[Trial], cfg: Config) -> Dict[str, Any]:
    done = list(trials)
    rec = sum(t.recovered for t in done)
    hangs = sum(t.hang for t in done)
    lost = [t.steps_lost for t in done if t.steps_lost is not None and t.kind != "nan"]
    by = {}
    for kind in ("kill", "stop", "damage", "nan") + SAFETY_KINDS:
        ts = [t for t in done if t.kind == kind]
        if not ts:
            continue
        d = {"trials": len(ts), "recovered": sum(t.recovered for t in ts), "hangs": sum(t.hang for t in ts)}
        if kind in ("kill", "stop", "damage", "staletmp", "malicious"):
            d["bit_exact"] = sum(bool(t.exact) for t in ts)
            d["max_steps_lost"] = max([t.steps_lost for t in ts if t.steps_lost is not None], default=None)
            rs = [t.recover_s for t in ts if t.recover_s is not None]
            d["recover_s_max"] = round(max(rs), 2) if rs else None
        if kind == "stop":
            ds = [t.detect_s for t in ts if t.detect_s is not None]
            d["detect_s_max"] = round(max(ds), 2) if ds else None
            d["stall_warning_named_it"] = sum(bool(t.detail.get("stall_warning_named_it")) for t in ts)
        if kind == "damage":
            d["detected"] = sum(bool(t.detail.get("detected")) for t in ts)
        if kind == "nan":
            d["max_abs_loss_diff"] = max((abs(t.loss_diff) for t in ts if t.loss_diff is not None), default=None)
        by[kind] = d
    line = (f"{rec}/{len(done)} trials recovered, {hangs} hangs, max steps lost "
            f"{max(lost) if lost else '-'} (checkpoint interval K={cfg.sync_every})")
    safety = [f"{SAFETY_LABELS[k]} {by[k]['recovered']}/{by[k]['trials']}" for k in SAFETY_KINDS if k in by]
    if safety:
        line += "; checkpoint safety: " + ", ".join(safety)
    return {"line": line, "recovered": rec, "trials": len(done), "hangs": hangs,
            "max_steps_lost": max(lost) if lost else None, "by_kind": by}


SAFETY_KINDS = ("malicious", "badload", "bgfail", "staletmp")
SAFETY_LABELS = {"malicious": "malicious pickle refused (no code ran)",
                 "badload": "failed load left the model untouched",
                 "bgfail": "failed final background save reported",
                 "staletmp": "stale tmp cleaned"}


# One summary line per kind of fault, from its aggregate ``k``.
KIND_LINES = {
    "kill": lambda k, cfg: (f"SIGKILL: {k['recovered']}/{k['trials']} resumed bit-exact, {k['hangs']} hangs, "
                            f"max steps lost {k['max_steps_lost']} (K={cfg.sync_every}), recovery <= "
                            f"{k['recover_s_max']} s"),
    "stop": lambda k, cfg: (f"SIGSTOP: {k['recovered']}/{k['trials']} SyncError naming the sync within the "
                            f"timeout ({cfg.stop_timeout_s:g} s) + {DETECT_MARGIN_S:g} s (max {k['detect_s_max']} "
                            f"s), then resumed bit-exact; {k['hangs']} hangs; stall warning named the rank in "
                            f"{k['stall_warning_named_it']}"),
    "damage": lambda k, cfg: (f"damaged checkpoint: {k['detected']}/{k['trials']} detected (file named, every "
                              f"rank), {k['recovered']}/{k['trials']} fell back to the previous one and finished "
                              "bit-exact"),
    "nan": lambda k, cfg: (f"NaN rank: {k['recovered']}/{k['trials']} no vote + warning naming it + the job went "
                           f"on; max |final loss - uninterrupted| {k['max_abs_loss_diff']:.3g}"),
    "malicious": lambda k, cfg: (f"malicious pickle: {k['recovered']}/{k['trials']} refused on every rank with no "
                                 "code run, fell back to the previous checkpoint and finished bit-exact"),
    "badload": lambda k, cfg: (f"failed load: {k['recovered']}/{k['trials']} ConfigError on every rank, model and "
                               "optimizer state unchanged, the run went on bit-exact"),
    "bgfail": lambda k, cfg: (f"failed final background save: {k['recovered']}/{k['trials']} reported on every rank "
                              "(file and cause named), job exited non-zero, previous checkpoint kept"),
    "staletmp": lambda k, cfg: (f"stale tmp: {k['recovered']}/{k['trials']} killed write's temp file removed by the "
                                f"next save, resumed bit-exact (max steps lost {k['max_steps_lost']})"),
}


def kind_lines(s: Dict[str, Any], cfg: Config) -> List[str]:
    return [line(s["by_kind"][kind], cfg) for kind, line in KIND_LINES.items() if kind in s["by_kind"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--kills", type=int, default=21, help="SIGKILL trials (a third each: inner step, collective, checkpoint)")
    p.add_argument("--stops", type=int, default=4, help="SIGSTOP trials (hung peer)")
    p.add_argument("--damages", type=int, default=6, help="damaged-checkpoint trials (truncate, flip, missing)")
    p.add_argument("--nans", type=int, default=2, help="NaN-loss trials")
    p.add_argument("--malicious", type=int, default=2, help="crafted checkpoints whose unpickling runs code")
    p.add_argument("--badloads", type=int, default=2, help="loads refused for another sync_every (nothing written)")
    p.add_argument("--bgfails", type=int, default=2, help="last background save fails (disk full): reported at exit")
    p.add_argument("--staletmps", type=int, default=2, help="rank 0 killed inside a checkpoint write: temp cleaned")
    p.add_argument("--worlds", default="2,3", help="world sizes, trials spread over them")
    p.add_argument("--chain", type=int, default=6, help="kill/stop trials per torchrun job (one per attempt)")
    p.add_argument("--seed", type=int, default=17, help="draws the ranks, steps and points of the faults")
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--sync-every", type=int, default=Config.sync_every, help="K: steps between syncs and checkpoints")
    p.add_argument("--stop-timeout", type=float, default=Config.stop_timeout_s,
                   help="collective timeout (s) of the stop trials' jobs")
    p.add_argument("--attempt-deadline", type=float, default=Config.attempt_deadline_s,
                   help="seconds allowed per attempt of a job before its process tree is killed (a hang)")
    p.add_argument("--work-dir", default=None, help="keep the jobs' directories here (default: a temp dir, removed)")
    p.add_argument("--json", default=None, help="write the trials and the summary here")
    a = p.parse_args(argv)

    cfg = Config(steps=a.steps, sync_every=a.sync_every, seed=0, stop_timeout_s=a.stop_timeout,
                 snapshot_at=(a.steps // 2 // a.sync_every) * a.sync_every, attempt_deadline_s=a.attempt_deadline)
    worlds = [int(w) for w in a.worlds.split(",")]
    jobs = plan(cfg, a.kills, a.stops, a.damages, a.nans, worlds, a.chain, a.seed, a.malicious, a.badloads,
                a.bgfails, a.staletmps)
    trials = [t for job in jobs for t in job]
    work = a.work_dir or tempfile.mkdtemp(prefix="flodl_faults_")
    os.makedirs(work, exist_ok=True)
    print(f"fault campaign: {len(trials)} trials in {len(jobs)} jobs (+{len(worlds)} uninterrupted runs), "
          f"ranks {worlds}, K={cfg.sync_every}, {cfg.steps} steps, seed {a.seed}; work dir {work}", flush=True)
    t0 = time.monotonic()
    refs: Dict[int, Reference] = {}
    for w in worlds:
        ref, res = reference_job(cfg, work, w)
        refs[w] = ref
        print(f"  uninterrupted {w}-rank run: {res.wall_s:.1f} s, final loss {ref.final_loss:.4f}", flush=True)
    judged = 0
    try:
        for j, job in enumerate(jobs):
            res = run_job(job, refs, cfg, work)
            for t in job:
                judged += 1
                elapsed = time.monotonic() - t0
                eta = elapsed / judged * (len(trials) - judged)
                print(f"[{judged:>3}/{len(trials)}] {row(t)} | {elapsed / 60:.1f} min, ETA {eta / 60:.1f} min",
                      flush=True)
            if res.hang:
                print(f"  job {j} outlived its deadline: process tree killed ({res.dir})", flush=True)
    finally:
        if a.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    summary = summarize(trials, cfg)
    print()
    print(HEADER)
    for t in trials:
        print(row(t))
    print()
    for line in kind_lines(summary, cfg):
        print(line)
    print(summary["line"])
    wall = time.monotonic() - t0
    print(f"campaign wall time {wall / 60:.1f} min")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"config": {**dataclasses.asdict(cfg), "worlds": worlds, "chain": a.chain, "seed": a.seed,
                                  "detect_margin_s": DETECT_MARGIN_S, "wall_s": wall,
                                  "command": "python tools/fault_campaign.py " + " ".join(argv or sys.argv[1:])},
                       "summary": summary, "trials": [dataclasses.asdict(t) for t in trials]}, fh, indent=1)
    return 0 if summary["recovered"] == summary["trials"] and summary["hangs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
