"""Checkpoints for an exact resume, written only at a consensus point, atomically, by rank 0.

``save_checkpoint`` is collective (every rank of the optimizer's group calls it at the same
point of the loop, right after a sync). Rank 0 writes ONE file holding:

* the model's state dict (replicated after a sync; per rank for EASGD, where ranks keep drift);
* the optimizer: ``LocalSGDOptimizer.state_dict()``: the replicated outer state (anchor,
  momentum) once, and per rank the inner optimizer's state, the counters and the scheduler;
* RNG states per rank (torch, CUDA, numpy, python ``random``), so dropout and sampling continue
  exactly where they stopped;
* the user's ``extra`` per rank (epoch, data position, ...).

The write is atomic: a temp file in the checkpoint's directory, ``fsync``, ``os.replace`` onto
the final name, ``fsync`` of the directory. The file is the zip archive ``torch.save`` writes,
sealed with a CRC32 of all its bytes in the archive's comment (format version 2), so
``load_checkpoint`` refuses a truncated, bit-flipped or partly copied file, naming it, instead
of loading garbage; ``torch.load`` still reads the file as usual. A crash at any moment leaves either the previous
checkpoint or the new one, never a torn file. Because it only runs right after a successful
sync (``opt.steps_since_sync == 0``) and a failed sync restores the pre-sync weights and leaves
the counters untouched, a checkpoint never holds half-averaged weights.

``background=True`` takes a CPU copy at the consensus point and writes it from a thread, so the
loop does not wait on the disk. The next save (or ``wait_checkpoint()``) waits for it first and
reports its failure on every rank.

``load_checkpoint`` restores everything on every rank (the file must be visible to every rank,
e.g. a shared filesystem). If the world size changed between save and load, the replicated
state is used as is, and every rank takes rank 0's per-rank optimizer state, counters and extra.

Example (resumable under ``torchrun --max-restarts 3``)::

    import flodl_opt as flo
    flo.init()
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model, sync_every=16)
    extra = flo.load_checkpoint("ckpt/last.pt", model, opt, missing_ok=True) or {"step": 0}
    for step in range(extra["step"], total_steps):
        ...; opt.step()
        if opt.steps_since_sync == 0:   # a consensus point
            flo.save_checkpoint("ckpt/last.pt", model, opt, extra={"step": step + 1})
"""
from __future__ import annotations

import contextlib
import os
import random
import struct
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .errors import ConfigError
from .flat import state_dict_views
from .optimizer import STATE_KEY, LocalSGDOptimizer, unwrap_model

FORMAT = "flodl_opt.checkpoint"
# 2: the file carries a CRC32 seal (version 1 files, unsealed, still load).
FORMAT_VERSION = 2

PathLike = Union[str, "os.PathLike[str]"]

# The serializer, a module attribute so tests can make a write fail midway.
_serialize = torch.save

_pending: Optional["CheckpointWrite"] = None   # the background write in flight (rank 0 only)
_pending_lock = threading.Lock()


class CheckpointWrite:
    """A checkpoint write in flight (``background=True``) or done. ``wait()`` raises its error."""

    def __init__(self, path: str, payload: Optional[Dict[str, Any]], background: bool):
        self.path = path
        self.error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if payload is None:
            return
        if background:
            # Not a daemon: the interpreter waits for the write at exit instead of tearing it.
            self._thread = threading.Thread(target=self._run, args=(payload,),
                                            name="flodl-checkpoint-writer")
            self._thread.start()
        else:
            self._run(payload)

    def _run(self, payload: Dict[str, Any]) -> None:
        try:
            atomic_save(payload, self.path)
        except BaseException as exc:  # noqa: BLE001 - reported by wait() on every rank
            self.error = exc

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None:
            raise self.error


# ---------------------------------------------------------------------------- atomic write
def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: PathLike) -> None:
    """``torch.save`` to a temp file in the same directory, seal, fsync, rename over ``path``, fsync the dir.

    A crash at any moment leaves the previous file at ``path`` intact; a failed write leaves no
    temp file behind.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w+b") as f:
            _serialize(obj, f)
            _seal(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


# ---------------------------------------------------------------------------- the CRC32 seal
# The seal is the zip archive's comment (the zip format's own place for trailing text, so
# torch.load and zipfile read the file unchanged): the CRC32 and length of every byte before
# the end record's comment-length field. Fixed length, so a reader finds it at the end.
_SEAL_PREFIX = b"flodl_opt.checkpoint crc32="
_EOCD = b"PK\x05\x06"   # zip end-of-central-directory record: 22 bytes, then the comment
_EOCD_LEN = 22
_READ_CHUNK = 16 << 20


def _seal_bytes(crc: int, size: int) -> bytes:
    return b"%s%08x size=%020d" % (_SEAL_PREFIX, crc, size)


_SEAL_LEN = len(_seal_bytes(0, 0))


def _crc32(f, size: int) -> int:
    """CRC32 of the first ``size`` bytes of an open binary file, in chunks (bounded memory)."""
    f.seek(0)
    crc, left = 0, size
    buf = memoryview(bytearray(min(_READ_CHUNK, max(size, 1))))
    while left > 0:
        n = f.readinto(buf[:min(len(buf), left)])
        if not n:
            raise EOFError(f"file ended {left} bytes early")
        crc = zlib.crc32(buf[:n], crc)
        left -= n
    return crc


def _seal(f) -> None:
    """Put the seal into the zip archive that ``_serialize`` just wrote to ``f`` (opened ``w+b``)."""
    f.flush()
    end = f.seek(0, os.SEEK_END)
    f.seek(max(0, end - _EOCD_LEN))
    eocd = f.read(_EOCD_LEN)
    if len(eocd) != _EOCD_LEN or eocd[:4] != _EOCD or eocd[-2:] != b"\0\0":
        raise RuntimeError("the checkpoint serializer did not write a zip archive without a comment "
                           "(torch.save's format); cannot seal it")
    size = end - 2   # every byte before the comment length
    crc = _crc32(f, size)
    f.seek(size)
    f.write(struct.pack("<H", _SEAL_LEN) + _seal_bytes(crc, size))
    f.truncate()


def _check_seal(path: str) -> Optional[str]:
    """``None`` when the file's seal matches its bytes, ``"unsealed"`` when it has none, else the damage."""
    with open(path, "rb") as f:
        total = f.seek(0, os.SEEK_END)
        if total < _EOCD_LEN + _SEAL_LEN:
            return "unsealed"
        f.seek(total - _SEAL_LEN - 2)
        tail = f.read(_SEAL_LEN + 2)
        length, seal = struct.unpack("<H", tail[:2])[0], tail[2:]
        if length != _SEAL_LEN or not seal.startswith(_SEAL_PREFIX):
            return "unsealed"
        try:
            crc_text, size_text = seal[len(_SEAL_PREFIX):].split(b" size=")
            crc, size = int(crc_text, 16), int(size_text)
        except ValueError:
            crc, size = -1, -1
        if seal != _seal_bytes(crc, size):   # exact bytes: "A" and "a" parse alike as hex
            return f"its checksum seal is altered ({seal!r})"
        if size != total - _SEAL_LEN - 2:
            return f"it has {total - _SEAL_LEN - 2} bytes before its seal, the seal says {size}"
        actual = _crc32(f, size)
    if actual != crc:
        return f"its CRC32 is {actual:08x}, its seal says {crc:08x} (flipped bits, or a partial copy?)"
    return None


# ---------------------------------------------------------------------------- pieces
def _cpu(obj: Any, copy: bool) -> Any:
    """Tensors moved to CPU (copied when ``copy``: the background writer must not see later steps)."""
    if torch.is_tensor(obj):
        t = obj.detach()
        if t.device.type != "cpu":
            return t.to("cpu")
        return t.clone() if copy else t
    if isinstance(obj, OrderedDict):  # a module state dict: keep its _metadata (versions)
        out = OrderedDict((k, _cpu(v, copy)) for k, v in obj.items())
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = meta  # type: ignore[attr-defined]
        return out
    if isinstance(obj, dict):
        return {k: _cpu(v, copy) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu(v, copy) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_cpu(v, copy) for v in obj)
    return obj


def rng_state() -> Dict[str, Any]:
    """This process's RNG states, in types ``torch.load(weights_only=True)`` accepts."""
    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _group_info(opt: LocalSGDOptimizer):
    group = opt.process_group
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if not distributed:
        return group, 1, 0, 0
    src = dist.get_global_rank(group, 0) if group is not None else 0
    return group, dist.get_world_size(group), dist.get_rank(group), src


def _agree(error: Optional[str], group, world: int, what: str) -> None:
    """Every rank raises if any rank failed (so nobody waits in a collective for a rank that left)."""
    if world == 1:
        if error is not None:
            raise RuntimeError(error)
        return
    errors: List[Optional[str]] = [None] * world
    dist.all_gather_object(errors, error, group=group)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        lines = "\n".join(f"  rank {r}: {e}" for r, e in bad)
        # Bad input stays a ConfigError on every rank (the same list decides it everywhere).
        cls = ConfigError if any(e.startswith("ConfigError") for _, e in bad) else RuntimeError
        raise cls(f"flodl_opt: {what} failed on rank(s) {[r for r, _ in bad]}:\n{lines}")


def _check_args(path, model, opt) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"checkpoint path must be a str or os.PathLike, got {type(path).__name__}")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be the nn.Module being trained, got {type(model).__name__}")
    if not isinstance(opt, LocalSGDOptimizer):
        raise ConfigError(f"opt must be the LocalSGDOptimizer training the model, got "
                          f"{type(opt).__name__}; wrap it: flo.LocalSGDOptimizer(opt, model=model)")
    return os.fspath(path)


# ---------------------------------------------------------------------------- save / load
def wait_checkpoint() -> None:
    """Wait for the background checkpoint write in flight, if any; raise its error."""
    global _pending
    with _pending_lock:
        pending, _pending = _pending, None
    if pending is not None:
        pending.wait()


def save_checkpoint(path: PathLike, model: nn.Module, opt: LocalSGDOptimizer,
                    extra: Any = None, *, sync: bool = False, background: bool = False,
                    per_rank: bool = True) -> Optional[CheckpointWrite]:
    """Write an exact-resume checkpoint at a consensus point. Collective: every rank calls it.

    Args:
        path: the checkpoint file (replaced atomically; its directory is created).
        model: the model being trained (or its DDP wrapper).
        opt: its LocalSGDOptimizer.
        extra: anything picklable to restore with it (epoch, step, data position); per rank.
        sync: run ``opt.sync()`` first (a collective) when not called right after a sync.
        background: write from a thread; the loop only pays for a CPU copy. Returns the
            write's handle on rank 0; the next save or ``wait_checkpoint()`` waits for it.
        per_rank: keep every rank's inner optimizer state (default). ``False`` keeps rank 0's
            only (smaller file; on resume every rank starts from rank 0's inner state).

    Returns rank 0's :class:`CheckpointWrite` (done unless ``background``), ``None`` elsewhere.

    Raises ConfigError between syncs (``sync=False``); a write that failed raises on every rank.
    """
    global _pending
    path = _check_args(path, model, opt)
    if sync:
        opt.sync()
    elif opt.steps_since_sync != 0:
        raise ConfigError(
            f"flodl_opt.save_checkpoint: called {opt.steps_since_sync} step(s) after the last sync, so "
            "the ranks' weights differ. Save right after a sync (when opt.steps_since_sync == 0), or "
            "pass sync=True to sync first (every rank must call it).")
    group, world, rank, src = _group_info(opt)

    # A failed background write must fail every rank, at the next save at the latest.
    prev_error = None
    if rank == 0:
        try:
            wait_checkpoint()
        except BaseException as exc:  # noqa: BLE001
            prev_error = f"background checkpoint write failed: {type(exc).__name__}: {exc}"
    _agree_from_root(prev_error, group, world, src)

    copy = background
    sd = opt.state_dict()
    outer = sd[STATE_KEY].pop("outer")
    inner_model = unwrap_model(model)
    replicated_params = getattr(opt.outer, "name", "") != "easgd"   # EASGD ranks keep their own drift
    piece: Dict[str, Any] = {"rng": rng_state(), "extra": _cpu(extra, copy)}
    if per_rank or rank == 0:
        piece["optimizer"] = _cpu(sd, copy)
    if not replicated_params:
        with state_dict_views():  # _cpu copies what it must; no second copy of the params
            piece["model"] = _cpu(inner_model.state_dict(), copy)
    if world > 1:
        pieces: Optional[List[Any]] = [None] * world if rank == 0 else None
        dist.gather_object(piece, pieces, dst=src, group=group)
    else:
        pieces = [piece]

    handle = None
    if rank == 0:
        with state_dict_views():
            model_sd = inner_model.state_dict() if replicated_params else None
        payload = {
            "format": FORMAT, "version": FORMAT_VERSION, "world_size": world, "time": time.time(),
            "replicated_params": replicated_params,
            "model": _cpu(model_sd, copy) if model_sd is not None else None,
            "outer": _cpu(outer, copy),
            "ranks": pieces,
        }
        handle = CheckpointWrite(path, payload, background)
        if background:
            with _pending_lock:
                _pending = handle
    if not background:
        error = None
        if rank == 0 and handle.error is not None:
            error = f"writing {path} failed: {type(handle.error).__name__}: {handle.error}"
        _agree_from_root(error, group, world, src)
    return handle


def _agree_from_root(error: Optional[str], group, world: int, src: int) -> None:
    """Rank 0's verdict, raised on every rank alike."""
    if world > 1:
        box = [error]
        dist.broadcast_object_list(box, src=src, group=group)
        error = box[0]
    if error is not None:
        raise RuntimeError(f"flodl_opt.save_checkpoint: {error}; the previous checkpoint is intact")


_MISSING = "no file at "


def load_checkpoint(path: PathLike, model: nn.Module, opt: LocalSGDOptimizer, *, strict: bool = True,
                    missing_ok: bool = False, restore_rng: bool = True,
                    weights_only: bool = False) -> Any:
    """Restore a checkpoint written by :func:`save_checkpoint` on every rank; return this rank's extra.

    Collective: every rank calls it (each reads the file: put it where every rank sees it).

    Args:
        strict: the optimizer's config must match the saved one (``False`` allows a new
            sync_every / gamma / warmup_steps).
        missing_ok: return ``None`` on every rank when no checkpoint exists yet (a fresh start).
        restore_rng: restore torch / CUDA / numpy / python RNG states (rank r gets rank r's;
            a rank the saved world did not have keeps its own).
        weights_only: passed to ``torch.load``. The default ``False`` unpickles arbitrary objects
            (your ``extra``): load only checkpoints you wrote.

    Same world size: each rank gets its own inner optimizer state, counters, RNG and extra.
    Different world size: replicated state (model, outer state) as saved, and every rank takes
    rank 0's inner optimizer state, counters and extra.
    """
    path = _check_args(path, model, opt)
    group, world, rank, _ = _group_info(opt)
    payload, error = None, None
    try:
        if not os.path.exists(path):
            error = _MISSING + path
        elif (damage := _check_seal(path)) not in (None, "unsealed"):
            error = (f"{path} is damaged: {damage}; it is not the file save_checkpoint wrote. Resume "
                     "from an earlier checkpoint, or copy the file again")
        else:
            payload = torch.load(path, map_location="cpu", weights_only=weights_only)
            if not (isinstance(payload, dict) and payload.get("format") == FORMAT):
                error = (f"{path} is not a flodl_opt checkpoint (written by flo.save_checkpoint); load "
                         "plain state dicts with model.load_state_dict / opt.load_state_dict")
            elif payload.get("version", 0) > FORMAT_VERSION:
                error = (f"{path} has checkpoint format version {payload['version']}, newer than this "
                         f"flodl_opt understands ({FORMAT_VERSION}); upgrade flodl_opt")
            elif damage == "unsealed" and payload.get("version", 0) >= 2:
                error = (f"{path} is damaged: its checksum seal is missing or altered (version "
                         f"{payload['version']} files are sealed when written). Resume from an earlier "
                         "checkpoint, or copy the file again")
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file: say so on every rank
        error = (f"{path} cannot be read ({type(exc).__name__}: {exc}); it is not a complete "
                 "checkpoint (flo.save_checkpoint never leaves a torn file at its path)")
    statuses: List[Optional[str]] = [error]
    if world > 1:
        statuses = [None] * world
        dist.all_gather_object(statuses, error, group=group)
    if all(s is not None and s.startswith(_MISSING) for s in statuses):
        if missing_ok:
            return None
        raise FileNotFoundError(f"flodl_opt.load_checkpoint: no checkpoint at {path}; pass "
                                "missing_ok=True to start fresh when there is none")
    bad = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if bad:
        lines = "\n".join(f"  rank {r}: {s}" for r, s in bad)
        hint = ("\nEvery rank reads the file: put it on a filesystem all ranks see."
                if any(s.startswith(_MISSING) for _, s in bad) else "")
        raise RuntimeError(f"flodl_opt.load_checkpoint failed on rank(s) {[r for r, _ in bad]}:\n{lines}"
                           + hint)

    error = None
    extra = None
    try:
        saved_world = payload["world_size"]
        pieces = payload["ranks"]
        mine = pieces[rank] if saved_world == world else pieces[0]
        opt_piece = mine.get("optimizer") or pieces[0]["optimizer"]
        model_sd = payload["model"] if payload["replicated_params"] else mine["model"]
        try:
            unwrap_model(model).load_state_dict(model_sd)
        except RuntimeError as exc:
            raise ConfigError(f"the checkpoint was saved for a different model ({exc}); build the same "
                              "model before loading it") from exc
        sd = dict(opt_piece)
        sd[STATE_KEY] = dict(sd[STATE_KEY], outer=payload["outer"])
        opt.load_state_dict(sd, strict=strict)
        if restore_rng and rank < saved_world:
            set_rng_state(pieces[rank]["rng"])
        extra = mine["extra"]
    except Exception as exc:  # noqa: BLE001
        if world == 1:
            raise
        error = f"{type(exc).__name__}: {exc}"
    _agree(error, group, world, f"loading checkpoint {path}")
    return extra
