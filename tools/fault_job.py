"""The training job that tools/fault_campaign.py breaks: the char-LM of examples/train_charlm.py,
checkpointed at every consensus point, resumable, with fault-injection points.

    torchrun --standalone --nproc-per-node 2 --max-restarts 2 tools/fault_job.py --dir /tmp/run

A tiny CharLM (one block, d=32, context 32) trains with AdamW wrapped in ``LocalSGDOptimizer``
(DiLoCo outer step, so the checkpoint holds an anchor and a momentum too). The batch of step s on
rank r is a pure function of (seed, r, s), so a resumed run is bit-identical to one that never
stopped. After every sync rank 0 keeps the previous checkpoint as ``prev.pt`` (a hard link) and
``flo.save_checkpoint`` writes ``last.pt``; on start every rank loads ``last.pt`` and, if that is
refused on any rank (damaged, or missing on some ranks), ``prev.pt``: the same choice on every
rank because ``load_checkpoint`` decides from one shared collective.

Faults are armed by the environment variable ``FLODL_FAULT``: a JSON list of faults, each for one
attempt (``TORCHELASTIC_RESTART_COUNT``), one rank and one 0-based step, so one torchrun job with
``--max-restarts N`` can host a chain of N faults, one per attempt::

    [{"attempt": 0, "kind": "kill", "rank": 1, "step": 9, "phase": "forward"}, ...]

* ``kill``: SIGKILL itself. phase ``forward`` (before the forward pass), ``backward`` (before the
  backward pass), ``optimizer`` (inside ``opt.step()``, right after the inner AdamW update),
  ``collective`` (inside a sync, right after issuing its ``call``-th all_reduce, ``step`` a sync
  step), ``checkpoint`` (inside ``save_checkpoint``: rank 0 after writing ``fraction`` of the
  file; any other rank after handing its piece to rank 0, while rank 0 writes).
* ``stop``: SIGSTOP itself at the same points (``optimizer`` or ``collective``): a hung peer.
* ``nan``: the loss of that step is NaN (so are the gradients and, after the step, the params).
* ``staletmp``: a ``kill`` of rank 0 inside a checkpoint write (phase ``checkpoint``), judged also
  on the killed write's temp file: there at the resume, gone after the next save.
* ``badload`` (every rank, a consensus step): after the save, rank 0 writes ``badload.pt``, the
  previous checkpoint with another ``sync_every``; every rank loads it, must get ``ConfigError``
  and keep its model, optimizer state and counters (digests before and after), and trains on.
* ``bgfail`` (rank 0, a consensus step; with ``--background``): from that save on, the checkpoint
  writer fails with ``OSError(ENOSPC)`` (a full disk), so the last background write fails; the
  job must end non-zero, every rank reporting it (``shutdown_error`` in ``<dir>/exit.jsonl``).

Every rank appends JSON lines to ``<dir>/log/rank<r>.jsonl``: start, resume (step, file, refused
files), params (a digest of the params after the resume and at every consensus point), fault,
sync_error, warning and log lines, done (final loss). At the end every rank writes its final
state dict to ``<dir>/final/rank<r>.pt``.

The fault points live here, around the library (a wrapped ``dist.all_reduce`` while one armed
``opt.step()`` runs, a wrapped checkpoint serializer, an inner-optimizer hook): nothing in
flodl_opt's code path checks for them.
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import logging
import math
import os
import signal
import sys
import time
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import flodl_opt as flo  # noqa: E402
from flodl_opt import checkpoint as ckpt_mod  # noqa: E402

FAULT_ENV = "FLODL_FAULT"
# The model and data of the README's demo, tiny (a trial is dominated by process start-up).
TINY = dict(d_model=32, heads=2, layers=1, context=32, batch_size=8, corpus_mb=0.2)


def _charlm():
    spec = importlib.util.spec_from_file_location("train_charlm", os.path.join(ROOT, "examples", "train_charlm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- the event log
class EventLog:
    """JSON lines, one small O_APPEND write each, flushed before any self-inflicted fault."""

    def __init__(self, directory: str, rank: int, attempt: int):
        os.makedirs(directory, exist_ok=True)
        self.fd = os.open(os.path.join(directory, f"rank{rank}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.base = {"rank": rank, "attempt": attempt, "pid": os.getpid()}

    def __call__(self, event: str, **fields: Any) -> None:
        rec = {"event": event, "t": time.time(), **self.base, **fields}
        os.write(self.fd, (json.dumps(rec) + "\n").encode())


# ----------------------------------------------------------------------------- fault points
class Fault:
    """One armed fault on this rank (or an inert one)."""

    def __init__(self, specs: List[Dict[str, Any]], rank: int, attempt: int, log: EventLog):
        mine = [s for s in specs if int(s.get("attempt", 0)) == attempt and int(s.get("rank", -1)) == rank]
        self.spec = mine[0] if mine else {}
        self.kind, self.phase = self.spec.get("kind"), self.spec.get("phase")
        self.step = int(self.spec.get("step", -1))
        self.log = log

    def armed(self, step: int, phase: str) -> bool:
        return self.kind is not None and step == self.step and phase == self.phase

    def fire(self, step: int, phase: str, **detail: Any) -> None:
        """Log the fault (the campaign reads the time and the step), then kill or stop this process."""
        self.log("fault", kind=self.kind, phase=phase, step=step, **detail)
        if self.kind in ("kill", "staletmp"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            self.log("continued", step=step)   # after SIGCONT (unless a signal ended us first)
        self.kind = None  # one shot


class _AllReduceTrap:
    """While active, the ``call``-th ``dist.all_reduce`` is issued and then the fault fires."""

    def __init__(self, fault: Fault, step: int):
        self.fault, self.step = fault, step
        self.target = int(fault.spec.get("call", 0))
        self.calls = 0
        self.real = dist.all_reduce

    def __enter__(self):
        trap = self

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            index, trap.calls = trap.calls, trap.calls + 1
            if index != trap.target:
                return trap.real(tensor, op=op, group=group, async_op=async_op)
            work = trap.real(tensor, op=op, group=group, async_op=True)   # in flight on the wire
            trap.fault.fire(trap.step, "collective", call=index, numel=tensor.numel())
            if async_op:
                return work
            work.wait()
            return None

        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.real
        return False


class _CheckpointTrap:
    """While active: rank 0 dies after writing part of the file; another rank after the gather."""

    def __init__(self, fault: Fault, step: int, rank: int):
        self.fault, self.step, self.rank = fault, step, rank
        self.fraction = float(fault.spec.get("fraction", 0.5))
        self.real_serialize, self.real_gather = ckpt_mod._serialize, dist.gather_object

    def __enter__(self):
        trap = self

        def serialize(obj, f):
            buf = io.BytesIO()
            trap.real_serialize(obj, buf)
            data = buf.getvalue()
            n = int(len(data) * trap.fraction)
            f.write(data[:n])
            f.flush()
            os.fsync(f.fileno())   # the torn temp file really is on disk
            trap.fault.fire(trap.step, "checkpoint", wrote=n, of=len(data))

        def gather_object(obj, object_gather_list=None, dst=0, group=None, **kw):
            out = trap.real_gather(obj, object_gather_list, dst=dst, group=group, **kw)
            trap.fault.fire(trap.step, "checkpoint", after="gather")   # rank 0 is writing now
            return out

        if self.rank == 0:
            ckpt_mod._serialize = serialize
        else:
            dist.gather_object = gather_object
        return self

    def __exit__(self, *exc):
        ckpt_mod._serialize, dist.gather_object = self.real_serialize, self.real_gather
        return False


# ----------------------------------------------------------------------------- the job
def _temps(ckpt_dir: str) -> List[str]:
    """Temp files of last.pt in the checkpoint directory (a killed write's, or one in flight)."""
    try:
        return sorted(n for n in os.listdir(ckpt_dir) if n.startswith(".last.pt.") and n.endswith(".tmp"))
    except FileNotFoundError:
        return []


def state_digest(model, opt) -> str:
    """SHA-1 of the model and everything in the optimizer's state dict (tensors, numbers, counters)."""
    import hashlib
    h = hashlib.sha1(digest(model).encode())

    def feed(obj) -> None:
        if torch.is_tensor(obj):
            h.update(obj.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=repr):
                h.update(repr(k).encode())
                feed(obj[k])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                feed(v)
        else:
            h.update(repr(obj).encode())
    feed(opt.state_dict())
    return h.hexdigest()


def _bad_load(ckpt_dir: str, model, opt, rank: int, log: EventLog) -> None:
    """Every rank loads the previous checkpoint with another sync_every: refused, nothing written."""
    bad = os.path.join(ckpt_dir, "badload.pt")
    if rank == 0:
        src = os.path.join(ckpt_dir, "prev.pt")   # other weights than the live ones
        payload = torch.load(src, map_location="cpu", weights_only=True)
        for piece in payload["ranks"]:
            if piece.get("optimizer") is not None:
                cfg = piece["optimizer"]["flodl_opt"]["config"]
                cfg["sync_every"] = cfg["sync_every"] + 1
        ckpt_mod.atomic_save(payload, bad)
    if dist.is_initialized():
        dist.barrier()
    before = state_digest(model, opt)
    try:
        flo.load_checkpoint(bad, model, opt)
        refused, message = False, None
    except flo.ConfigError as exc:
        refused, message = True, str(exc)[:2000]
    log("badload", refused=refused, message=message, same=state_digest(model, opt) == before)


def _disk_full_from_now() -> None:
    """The checkpoint writer fails like a full disk from now on (this rank)."""
    import errno

    def full(obj, f):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    ckpt_mod._serialize = full


def build(charlm, seed: int, sync_every: int, steps: int, stall_warning_s: Optional[float]):
    torch.manual_seed(seed)
    model = charlm.CharLM(256, TINY["d_model"], TINY["heads"], TINY["layers"], TINY["context"])
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.01)
    warm = 4

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10% (train_charlm's schedule)
        if step < warm:
            return (step + 1) / warm
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / max(1, steps - warm))))

    sched = torch.optim.lr_scheduler.LambdaLR(inner, lr_at)
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=sync_every, max_grad_norm=1.0,
                                lr_scheduler=sched, outer=flo.DiLoCo(lr=0.7, momentum=0.5),
                                stall_warning_s=stall_warning_s)
    return model, opt


def step_batch(charlm, data: torch.Tensor, seed: int, rank: int, step: int):
    """Step ``step``'s batch on ``rank``: the same on every attempt."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    return charlm.batch(data, TINY["batch_size"], TINY["context"], g)


@torch.no_grad()
def eval_loss(charlm, model, val: torch.Tensor, batches: int = 4) -> float:
    g = torch.Generator().manual_seed(1234)
    losses = [charlm.loss_fn(model, *charlm.batch(val, TINY["batch_size"], TINY["context"], g)).item()
              for _ in range(batches)]
    return sum(losses) / len(losses)


def resume(model, opt, load_dir: str, log: EventLog):
    """Load last.pt, else prev.pt; every rank makes the same choice. Returns (extra, path)."""
    refused: List[str] = []
    for name in ("last.pt", "prev.pt"):
        path = os.path.join(load_dir, name)
        try:
            extra = flo.load_checkpoint(path, model, opt, missing_ok=True)
        except flo.ConfigError:
            raise   # another model or config: not a damaged file, nothing to fall back to
        except RuntimeError as exc:   # refused on some rank: raised on every rank alike
            refused.append(str(exc))
            log("refused", path=path, message=str(exc))
            continue
        if extra is not None:
            return extra, path, refused
    if refused:
        raise RuntimeError("no usable checkpoint (every candidate was refused):\n" + "\n".join(refused))
    return None, None, refused


def _keep_previous(ckpt_dir: str) -> None:
    """prev.pt becomes the current last.pt (a hard link: last.pt itself is replaced atomically)."""
    last, prev = os.path.join(ckpt_dir, "last.pt"), os.path.join(ckpt_dir, "prev.pt")
    if not os.path.exists(last):
        return
    tmp = prev + ".link"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    try:
        os.link(last, tmp)
    except OSError:   # no hard links on this filesystem: a copy
        import shutil
        shutil.copyfile(last, tmp)
    os.replace(tmp, prev)


def train(args) -> None:
    """Every run of this launch (``--runs``; one unless the campaign batches load-time trials)."""
    flo.init(timeout=args.timeout)
    torch.set_num_threads(1)   # the same arithmetic on every attempt
    rank, world = flo.rank(), flo.size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    specs = json.loads(os.environ[FAULT_ENV]) if os.environ.get(FAULT_ENV) else []
    specs = [specs] if isinstance(specs, dict) else specs

    current: Dict[str, EventLog] = {}
    logging.getLogger("flodl_opt").addHandler(_LogHandler(current))
    real_showwarning = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        current["log"]("warning", category=category.__name__, message=str(message))
        real_showwarning(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    warnings.simplefilter("always", flo.NonFiniteWarning)

    charlm = _charlm()
    data = charlm.split(charlm.stdlib_corpus(int(TINY["corpus_mb"] * 1e6)))
    for run in range(args.runs):
        # Several runs in one launch: each in <dir>/run<k>, its faults those of "attempt" k.
        run_dir = args.dir if args.runs == 1 else os.path.join(args.dir, f"run{run}")
        label = attempt if args.runs == 1 else run
        log = current["log"] = EventLog(os.path.join(run_dir, "log"), rank, label)
        log("start", world=world)
        one_run(args, charlm, data, run_dir, rank, log, Fault(specs, rank, label, log), run)


def one_run(args, charlm, data, run_dir: str, rank: int, log: EventLog, fault: Fault, run: int) -> None:
    train_data, val_data = data
    model, opt = build(charlm, args.seed, args.sync_every, args.steps, args.stall_warning)
    if fault.kind in ("kill", "stop") and fault.phase == "optimizer":
        inner_step = [0]

        def after_inner_step(optimizer, a, kw):
            if fault.armed(inner_step[0], "optimizer"):
                fault.fire(inner_step[0], "optimizer")

        opt.optimizer.register_step_post_hook(after_inner_step)
    else:
        inner_step = None

    ckpt_dir = os.path.join(run_dir, "ckpt")
    load_dir = (args.load_dir or ckpt_dir).format(rank=rank, run=run)
    t0 = time.time()
    extra, used, refused = resume(model, opt, load_dir, log)
    start = extra["step"] if extra else 0
    log("resume", start=start, path=used, refused=refused, load_s=time.time() - t0)
    log("params", step=start, digest=digest(model))
    if rank == 0:
        log("temps", step=start, at="resume", names=_temps(ckpt_dir))

    losses: Dict[int, float] = {}
    try:
        for step in range(start, args.steps):
            if inner_step is not None:
                inner_step[0] = step
            if fault.armed(step, "forward"):
                fault.fire(step, "forward")
            x, y = step_batch(charlm, train_data, args.seed, rank, step)
            loss = charlm.loss_fn(model, x, y)
            if fault.kind == "nan" and step == fault.step:
                loss = loss * float("nan")
                log("fault", kind="nan", phase="loss", step=step)
                fault.kind = None
            if fault.armed(step, "backward"):
                fault.fire(step, "backward")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if fault.armed(step, "collective"):
                with _AllReduceTrap(fault, step):
                    opt.step()
            else:
                opt.step()
            losses[step] = loss.item()
            if opt.steps_since_sync == 0:   # a consensus point: keep the previous, write the new
                if rank == 0:
                    _keep_previous(ckpt_dir)
                if fault.kind == "bgfail" and step == fault.step:
                    log("fault", kind="bgfail", phase="checkpoint", step=step)
                    _disk_full_from_now()
                    fault.kind = None
                save = dict(extra={"step": step + 1}, background=args.background)
                if fault.armed(step, "checkpoint"):
                    with _CheckpointTrap(fault, step, rank):
                        flo.save_checkpoint(os.path.join(ckpt_dir, "last.pt"), model, opt, **save)
                else:
                    flo.save_checkpoint(os.path.join(ckpt_dir, "last.pt"), model, opt, **save)
                log("params", step=step + 1, digest=digest(model))
                if rank == 0 and not args.background:
                    log("temps", step=step + 1, at="save", names=_temps(ckpt_dir))
                if fault.kind == "badload" and step == fault.step:
                    _bad_load(ckpt_dir, model, opt, rank, log)
                    fault.kind = None
                if step + 1 == args.snapshot_at and rank == 0:
                    _snapshot(ckpt_dir, os.path.join(run_dir, "snapshot"))
        if opt.steps_since_sync:
            opt.sync()   # end on a consensus
    except flo.SyncError as exc:
        log("sync_error", sync=exc.sync, message=str(exc), restored=exc.restored)
        raise
    except BaseException as exc:
        log("error", type=type(exc).__name__, message=str(exc)[:2000])
        raise
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    os.makedirs(os.path.join(run_dir, "final"), exist_ok=True)
    out = os.path.join(run_dir, "final", f"rank{rank}.pt")
    torch.save(final, out + ".tmp")
    os.replace(out + ".tmp", out)
    log("done", start=start, steps=args.steps, final_loss=eval_loss(charlm, model, val_data),
        losses={str(k): v for k, v in losses.items()}, syncs=opt.sync_count, digest=digest(model))


def digest(model) -> str:
    """SHA-1 of every param and buffer's bytes: equal digests are bit-identical states."""
    import hashlib
    h = hashlib.sha1()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _snapshot(src: str, dst: str) -> None:
    import shutil
    os.makedirs(dst, exist_ok=True)
    for name in ("last.pt", "prev.pt"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


class _LogHandler(logging.Handler):
    def __init__(self, current: Dict[str, EventLog]):
        super().__init__(logging.WARNING)
        self.current = current

    def emit(self, record: logging.LogRecord) -> None:
        self.current["log"]("log", message=record.getMessage())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="run directory: ckpt/, log/, final/ (snapshot/)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout (s), flo.init(timeout=)")
    p.add_argument("--stall-warning", type=float, default=None, help="stall_warning_s (s)")
    p.add_argument("--load-dir", default=None,
                   help="where each rank reads its checkpoints ({rank} and {run} are replaced); default "
                        "<dir>/ckpt")
    p.add_argument("--runs", type=int, default=1,
                   help="independent runs in this launch, each in <dir>/run<k> with the faults of attempt k")
    p.add_argument("--background", action="store_true", help="save_checkpoint(background=True)")
    p.add_argument("--snapshot-at", type=int, default=-1,
                   help="after the checkpoint of this step, rank 0 copies last.pt and prev.pt to <dir>/snapshot")
    return p.parse_args(argv)


def _exit_record(a, event: str, **fields: Any) -> None:
    with open(os.path.join(a.dir, "exit.jsonl"), "a") as fh:
        fh.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(),
                             "rank": int(os.environ.get("RANK", "0")),
                             "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                             **fields}) + "\n")


def _shutdown(a) -> None:
    try:
        flo.shutdown()
    except Exception as exc:   # a failed last background write: recorded, then the job fails
        _exit_record(a, "shutdown_error", type=type(exc).__name__, message=str(exc)[:2000])
        raise


if __name__ == "__main__":
    a = parse_args()
    try:
        train(a)
    finally:
        _shutdown(a)
    _exit_record(a, "exit")
