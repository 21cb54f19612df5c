"""Checkpoints for an exact resume, written only at a consensus point, atomically, by rank 0.

``save_checkpoint`` is collective (every rank of the optimizer's group calls it at the same
point of the loop, right after a sync). Rank 0 writes ONE file holding:

* the model's state dict (replicated after a sync; per rank for EASGD, where ranks keep drift);
* the optimizer: ``LocalSGDOptimizer.state_dict()``: the replicated outer state (anchor,
  momentum) once, and per rank the inner optimizer's state, the counters and the scheduler;
* RNG states per rank (torch, CUDA, numpy, python ``random``), so dropout and sampling continue
  exactly where they stopped;
* the user's ``extra`` per rank (epoch, data position, ...).

Loading runs no code from the file. The file holds tensors and plain data only (dicts, lists,
tuples, sets, strings, numbers, ``None``; numpy arrays and scalars are stored as bytes and come
back as numpy), and ``load_checkpoint`` reads it with ``torch.load(weights_only=True)``, whose
unpickler refuses any other object: a crafted file is refused, naming it, on every rank, before
anything is changed. ``save_checkpoint`` refuses an ``extra`` that is not plain data (a
dataclass, a custom class) up front, so every file it writes loads this way. A trusted file
written by an older flodl_opt with such objects loads with ``trusted=True``, which warns:
unpickling runs whatever code the file names.

The write is atomic: a temp file in the checkpoint's directory, ``fsync``, ``os.replace`` onto
the final name, ``fsync`` of the directory. The file is the zip archive ``torch.save`` writes,
sealed with a CRC32 of all its bytes in the archive's comment (format version 2), so
``load_checkpoint`` refuses a truncated, bit-flipped or partly copied file, naming it, instead
of loading garbage; ``torch.load`` still reads the file as usual. The seal detects damage, not
tampering: anyone can recompute a CRC32. For tamper detection pass a secret ``key`` to both
``save_checkpoint`` and ``load_checkpoint``: the seal then also carries an HMAC-SHA256 of the
bytes (format version 3), and a file whose HMAC does not verify with the key, or that has none,
is refused. A crash at any moment leaves either the previous
checkpoint or the new one, never a torn file; a write killed midway leaves its temp file
(``.<name>.<8 characters>.tmp``), which the next save of the same checkpoint removes (only
temp files of that name, and only those no live writer holds a lock on). Because it only runs
right after a successful
sync (``opt.steps_since_sync == 0``) and a failed sync restores the pre-sync weights and leaves
the counters untouched, a checkpoint never holds half-averaged weights.

``background=True`` takes a CPU copy at the consensus point and writes it from a thread, so the
loop does not wait on the disk. The next save waits for it first and reports its failure on
every rank; ``wait_checkpoint()`` waits for it and raises its failure on the rank that calls it
(any rank: the others learn rank 0's result through the process group's store). A failure of
the last background write that nothing reported is reported by ``flo.shutdown()`` (it raises
:class:`CheckpointWriteError` on every rank) or else at interpreter exit, where every rank prints
``flodl_opt: ERROR: ...`` naming the file and the cause on stderr and exits with status 1 (see
:func:`_report_at_exit`).

``load_checkpoint`` restores everything on every rank (the file must be visible to every rank,
e.g. a shared filesystem). It checks everything first (the file on every rank, the model's keys
and shapes, the optimizer's config and shapes, on every rank) and writes only when every rank
passed: a refused checkpoint leaves the model, the optimizer and its counters untouched. If the
world size changed between save and load, the replicated state is used as is, and every rank
takes rank 0's per-rank optimizer state, counters and extra.

A collective of ``save_checkpoint`` / ``load_checkpoint`` that fails (a dead or hung peer) raises
:class:`CheckpointSyncError`, a ``flo.SyncError``, naming the rank and the step.

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

import atexit
import contextlib
import datetime
import errno
import hashlib
import hmac
import logging
import os
import pickle
import random
import re
import struct
import sys
import tempfile
import threading
import time
import warnings
import zipfile
import zlib
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from .errors import ConfigError, SyncError
from .sync.flat import state_dict_views
from .checks import unwrap_model
from .optimizer import LocalSGDOptimizer
from .provenance import STATE_KEY

try:
    import fcntl
except ImportError:  # not on POSIX: no lock, stale temp files are still removed
    fcntl = None  # type: ignore[assignment]

FORMAT = "flodl_opt.checkpoint"
# 2: the file carries a CRC32 seal (version 1 files, unsealed, still load).
# 3: the seal also carries an HMAC-SHA256 (written with key=; older readers say "upgrade").
FORMAT_VERSION = 2      # what a save without key= writes
_KEYED_VERSION = 3      # what a save with key= writes; the newest version load_checkpoint reads

PathLike = Union[str, "os.PathLike[str]"]
KeyLike = Union[bytes, str]

# The serializer, a module attribute so tests can make a write fail midway.
_serialize = torch.save

_pending: Optional["CheckpointWrite"] = None   # the background write in flight (rank 0 only)
_pending_lock = threading.Lock()


class CheckpointSyncError(SyncError):
    """A collective of ``save_checkpoint`` / ``load_checkpoint`` failed (a dead, hung or absent peer).

    A ``flo.SyncError``: ``rank``, ``sync`` (the sync count when it failed) and ``cause`` say
    where and why; ``restored`` is True when nothing was changed on this rank.
    """

    def __init__(self, rank: int, sync: int, cause: BaseException, what: str, state: str):
        self.rank, self.sync, self.cause, self.restored = rank, sync, cause, True
        RuntimeError.__init__(
            self, f"flodl_opt: {what} failed on rank {rank} (after sync #{sync}): "
                  f"{type(cause).__name__}: {cause}; {state}. A peer died, hung, or did not call it "
                  "(every rank must call save_checkpoint / load_checkpoint alike). Exit and resume from "
                  "the last checkpoint (torchrun --max-restarts does it for you).")


class CheckpointWriteError(RuntimeError):
    """The last background checkpoint write failed and nothing had reported it yet."""


class UnsafeCheckpointWarning(UserWarning):
    """A checkpoint is being unpickled without ``weights_only``: it can run arbitrary code."""


class CheckpointWrite:
    """A checkpoint write in flight (``background=True``) or done. ``wait()`` raises its error."""

    def __init__(self, path: str, payload: Optional[Dict[str, Any]], background: bool,
                 key: Optional[bytes] = None, on_done: Optional[Callable[["CheckpointWrite"], None]] = None):
        self.path = path
        self.error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._key, self._on_done = key, on_done
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
            atomic_save(payload, self.path, key=self._key)
        except BaseException as exc:  # noqa: BLE001 - reported by wait() on every rank
            self.error = exc
        if self._on_done is not None:
            self._on_done(self)

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None:
            raise self.error

    def describe_error(self) -> Optional[str]:
        if self.error is None:
            return None
        return f"writing {self.path} failed: {type(self.error).__name__}: {self.error}"


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


def _temp_pattern(name: str) -> "re.Pattern[str]":
    """Our temp files of target ``name``: mkstemp's ``.<name>.<8 of [a-z0-9_]>.tmp``, nothing else.

    The length of the random part is fixed, so another target's temp file never matches."""
    return re.compile(r"\." + re.escape(name) + r"\.[a-z0-9_]{8}\.tmp\Z")


def _lock(fd: int) -> Optional[bool]:
    """Try an exclusive lock: True held, False held by someone else, None no locks here."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None  # the filesystem does not lock (ENOLCK, EOPNOTSUPP)


def clean_stale_temp_files(path: PathLike, keep: Optional[str] = None) -> List[str]:
    """Remove temp files a killed write of ``path`` left (ours by name; never another target's).

    A writer holds a lock on its temp file until it is renamed, so a temp file whose lock we
    get belongs to a dead writer; one locked by a live writer is left alone. Returns the removed paths.
    """
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    pattern, removed = _temp_pattern(name), []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for entry in names:
        full = os.path.join(directory, entry)
        if not pattern.match(entry) or full == keep:
            continue
        try:
            fd = os.open(full, os.O_RDONLY)
        except OSError:
            continue
        try:
            if _lock(fd) is not False and os.path.isfile(full):
                os.unlink(full)
                removed.append(full)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


class _WriteErrors:
    """The file, remembering the first OSError its ``write`` raised (a full disk, an I/O error)."""

    def __init__(self, f):
        self._f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _serialize_naming_os_errors(obj: Any, f) -> None:
    """``_serialize(obj, f)``; a failed write raises its OSError ("No space left on device"), not
    the zip writer's own message for it ("unexpected pos ...")."""
    sink = _WriteErrors(f)
    try:
        _serialize(obj, sink)
    except Exception as exc:
        if sink.error is not None and sink.error is not exc:
            raise sink.error from exc
        raise


def atomic_save(obj: Any, path: PathLike, key: Optional[bytes] = None) -> None:
    """``torch.save`` to a temp file in the same directory, seal, fsync, rename over ``path``, fsync the dir.

    A crash at any moment leaves the previous file at ``path`` intact; a failed write leaves no
    temp file behind, and temp files that killed writes of ``path`` left are removed first.
    ``key``: the seal also carries an HMAC-SHA256 of the bytes under it.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    lock_fd = os.dup(fd)   # held until the rename: the lock tells a live write from a dead one's file
    try:
        _lock(lock_fd)
        clean_stale_temp_files(path, keep=tmp)
        with os.fdopen(fd, "w+b") as f:
            _serialize_naming_os_errors(obj, f)
            _seal(f) if key is None else _seal(f, key)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        os.close(lock_fd)
    _fsync_dir(directory)


# ---------------------------------------------------------------------------- the seal
# The seal is the zip archive's comment (the zip format's own place for trailing text, so
# torch.load and zipfile read the file unchanged): the CRC32 and length of every byte before
# the end record's comment-length field, and with a key their HMAC-SHA256. Fixed lengths, so a
# reader finds it at the end. The CRC32 detects damage only (anyone can recompute it); the HMAC
# detects tampering by whoever does not hold the key.
_SEAL_PREFIX = b"flodl_opt.checkpoint crc32="
_MAC_FIELD = b" hmac-sha256="
_EOCD = b"PK\x05\x06"   # zip end-of-central-directory record: 22 bytes, then the comment
_EOCD_LEN = 22
_READ_CHUNK = 16 << 20


def _seal_bytes(crc: int, size: int, mac: Optional[bytes] = None) -> bytes:
    seal = b"%s%08x size=%020d" % (_SEAL_PREFIX, crc, size)
    return seal + _MAC_FIELD + mac.hex().encode() if mac is not None else seal


_SEAL_LEN = len(_seal_bytes(0, 0))
_KEYED_SEAL_LEN = len(_seal_bytes(0, 0, bytes(32)))


def _digest(f, size: int, key: Optional[bytes]) -> Tuple[int, Optional[bytes]]:
    """CRC32 (and HMAC-SHA256 under ``key``) of the first ``size`` bytes of a binary file, in chunks."""
    f.seek(0)
    crc, left = 0, size
    mac = hmac.new(key, digestmod=hashlib.sha256) if key is not None else None
    buf = memoryview(bytearray(min(_READ_CHUNK, max(size, 1))))
    while left > 0:
        n = f.readinto(buf[:min(len(buf), left)])
        if not n:
            raise EOFError(f"file ended {left} bytes early")
        crc = zlib.crc32(buf[:n], crc)
        if mac is not None:
            mac.update(buf[:n])
        left -= n
    return crc, mac.digest() if mac is not None else None


def _seal(f, key: Optional[bytes] = None) -> None:
    """Put the seal into the zip archive that ``_serialize`` just wrote to ``f`` (opened ``w+b``)."""
    f.flush()
    end = f.seek(0, os.SEEK_END)
    f.seek(max(0, end - _EOCD_LEN))
    eocd = f.read(_EOCD_LEN)
    if len(eocd) != _EOCD_LEN or eocd[:4] != _EOCD or eocd[-2:] != b"\0\0":
        raise RuntimeError("the checkpoint serializer did not write a zip archive without a comment "
                           "(torch.save's format); cannot seal it")
    size = end - 2   # every byte before the comment length
    crc, mac = _digest(f, size, key)
    seal = _seal_bytes(crc, size, mac)
    f.seek(size)
    f.write(struct.pack("<H", len(seal)) + seal)
    f.truncate()


def _read_seal(f, total: int) -> Optional[bytes]:
    """The seal at the end of the file, or None when it has none."""
    for length in (_KEYED_SEAL_LEN, _SEAL_LEN):
        if total < _EOCD_LEN + length + 2:
            continue
        f.seek(total - length - 2)
        tail = f.read(length + 2)
        if struct.unpack("<H", tail[:2])[0] == length and tail[2:].startswith(_SEAL_PREFIX):
            return tail[2:]
    return None


def _check_seal(path: str, key: Optional[bytes] = None) -> Optional[str]:
    """``None`` when the seal matches the bytes (and, under ``key``, their HMAC verifies),
    ``"unsealed"`` when the file has none, else what is wrong."""
    with open(path, "rb") as f:
        total = f.seek(0, os.SEEK_END)
        seal = _read_seal(f, total)
        if seal is None:
            return "unsealed"
        try:
            body, _, mac_text = seal.partition(_MAC_FIELD)
            crc_text, size_text = body[len(_SEAL_PREFIX):].split(b" size=")
            crc, size = int(crc_text, 16), int(size_text)
            mac = bytes.fromhex(mac_text.decode()) if mac_text else None
        except ValueError:
            crc, size, mac = -1, -1, None
        if seal != _seal_bytes(crc, size, mac):   # exact bytes: "A" and "a" parse alike as hex
            return f"its checksum seal is altered ({seal!r})"
        if size != total - len(seal) - 2:
            return f"it has {total - len(seal) - 2} bytes before its seal, the seal says {size}"
        if key is not None and mac is None:
            return ("it carries no HMAC: it was written without key=, or by someone without the key, "
                    "so it cannot be verified")
        actual, actual_mac = _digest(f, size, key if mac is not None else None)
    if actual != crc:
        return f"its CRC32 is {actual:08x}, its seal says {crc:08x} (flipped bits, or a partial copy?)"
    if key is not None and not hmac.compare_digest(actual_mac, mac):
        return ("its HMAC-SHA256 does not verify with this key: it was changed after it was written, "
                "or written with another key")
    return None


# ---------------------------------------------------------------------------- plain data
# What torch.load(weights_only=True) rebuilds without running code from the file. numpy
# arrays and scalars are not in it: they are stored as their bytes under a tag and rebuilt.
_LEAVES = (str, bytes, bytearray, int, float, bool, complex, type(None), torch.dtype, torch.device,
           torch.Size)
_NUMPY_TAG = "__flodl_opt.numpy__"


def _where(path: List[Any]) -> str:
    return "".join(f"[{p!r}]" for p in path)


def _not_plain(obj: Any, what: str, path: List[Any]) -> ConfigError:
    kind = type(obj)
    return ConfigError(
        f"flodl_opt.save_checkpoint: {what}{_where(path)} is a {kind.__module__}.{kind.__qualname__}; a "
        "checkpoint holds only tensors and plain data (dict, list, tuple, set, str, bytes, int, float, "
        "bool, None, numpy arrays), so that loading it can run no code. Convert it to plain data "
        "(dataclasses.asdict(x), x.isoformat(), a dict of its fields) and rebuild it after "
        "load_checkpoint")


def _numpy_to_plain(obj: Any, what: str, path: List[Any]) -> Dict[str, Any]:
    import numpy as np
    arr = np.asarray(obj)
    if arr.dtype.hasobject or arr.dtype.fields is not None:
        raise _not_plain(obj, what, path)
    return {_NUMPY_TAG: arr.dtype.str, "shape": list(arr.shape), "scalar": isinstance(obj, np.generic),
            "data": np.ascontiguousarray(arr).tobytes()}


def _is_numpy(obj: Any) -> bool:
    return type(obj).__module__ == "numpy" and hasattr(obj, "dtype") and hasattr(obj, "tobytes")


def _is_model_state_dict(obj: Any) -> bool:
    from .dcp import ModelStateDict
    return type(obj) is ModelStateDict


def _plain(obj: Any, copy: bool, what: str = "extra", path: Optional[List[Any]] = None) -> Any:
    """``obj`` as plain data for the file: tensors on CPU (copied when ``copy``: the background
    writer must not see later steps), numpy as tagged bytes; anything else is a ConfigError."""
    path = [] if path is None else path
    kind = type(obj)
    if isinstance(obj, torch.Tensor):
        if kind not in (torch.Tensor, nn.Parameter):
            raise _not_plain(obj, what, path)
        t = obj.detach()
        if t.device.type != "cpu":
            return t.to("cpu")
        return t.clone() if copy else t
    if kind in _LEAVES:
        return obj
    if kind in (dict, OrderedDict) or _is_model_state_dict(obj):
        out = dict() if kind is dict else OrderedDict()  # a wrapped model's (flodl_opt/dcp.py): a plain one
        for k, v in obj.items():
            if type(k) not in _LEAVES:
                raise _not_plain(k, what, path + ["<key>"])
            out[k] = _plain(v, copy, what, path + [k])
        meta = getattr(obj, "_metadata", None)
        if meta is not None:  # a module state dict: keep its _metadata (versions)
            out._metadata = _plain(meta, False, what, path + ["_metadata"])  # type: ignore[attr-defined]
        return out
    if kind in (list, tuple):
        return kind(_plain(v, copy, what, path + [i]) for i, v in enumerate(obj))
    if kind is set:
        return {_plain(v, copy, what, path + ["<item>"]) for v in obj}
    if _is_numpy(obj):
        return _numpy_to_plain(obj, what, path)
    raise _not_plain(obj, what, path)


def _unplain(obj: Any) -> Any:
    """Inverse of ``_plain``'s numpy encoding; everything else as loaded."""
    kind = type(obj)
    if kind is dict and _NUMPY_TAG in obj:
        import numpy as np
        arr = np.frombuffer(obj["data"], dtype=np.dtype(obj[_NUMPY_TAG])).reshape(obj["shape"]).copy()
        return arr[()] if obj["scalar"] else arr
    if kind in (dict, OrderedDict):
        out = kind((k, _unplain(v)) for k, v in obj.items())
        if getattr(obj, "_metadata", None) is not None:
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if kind in (list, tuple):
        return kind(_unplain(v) for v in obj)
    return obj


# ---------------------------------------------------------------------------- RNG
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


def _check_rng_state(state: Any) -> None:
    """Raise ConfigError unless ``set_rng_state(state)`` would take it whole (so it writes all or nothing)."""
    ok = (isinstance(state, dict) and torch.is_tensor(state.get("torch"))
          and state["torch"].dtype == torch.uint8 and isinstance(state.get("numpy"), (tuple, list))
          and len(state["numpy"]) == 5 and torch.is_tensor(state["numpy"][1])
          and isinstance(state.get("python"), (tuple, list)) and len(state["python"]) == 3)
    if not ok:
        raise ConfigError("the checkpoint's RNG state is not the one save_checkpoint writes; load it "
                          "with restore_rng=False")


def set_rng_state(state: Dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


# ---------------------------------------------------------------------------- collectives
def _group_info(opt: LocalSGDOptimizer):
    group = opt.process_group
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if not distributed:
        return group, 1, 0, 0
    src = dist.get_global_rank(group, 0) if group is not None else 0
    return group, dist.get_world_size(group), dist.get_rank(group), src


def _collective(opt: LocalSGDOptimizer, what: str, state: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a collective; its failure (Gloo/NCCL error, timeout) as a SyncError."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the backend raises RuntimeError subclasses of its own
        rank = dist.get_rank(opt.process_group) if dist.is_initialized() else 0
        raise CheckpointSyncError(rank, opt.sync_count, exc, what, state) from exc


def _gather_errors(opt: LocalSGDOptimizer, error: Optional[str], group, world: int, what: str,
                   state: str) -> List[Optional[str]]:
    if world == 1:
        return [error]
    errors: List[Optional[str]] = [None] * world
    _collective(opt, what, state, dist.all_gather_object, errors, error, group=group)
    return errors


def _raise_bad(errors: List[Optional[str]], what: str, world: int) -> None:
    """Every rank raises if any rank failed (so nobody waits in a collective for a rank that left)."""
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not bad:
        return
    if world == 1:
        msg = bad[0][1]
        if msg.startswith("ConfigError: "):
            raise ConfigError(msg[len("ConfigError: "):])
        raise RuntimeError(msg)
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


def _check_key(key: Optional[KeyLike]) -> Optional[bytes]:
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)) or len(key) == 0:
        raise ConfigError(f"checkpoint key must be non-empty bytes or str (a secret), got {type(key).__name__}")
    return bytes(key)


# ---------------------------------------------------------------------------- background writes
# Every rank remembers the last background write until something reported its outcome (the
# next save on every rank; wait_checkpoint, shutdown or the exit on the rank that calls it).
# Rank 0's writer publishes the outcome under a key in the default process group's store; the
# other ranks read it there (and count themselves in, so rank 0, which may host the store,
# stays until they have read it). The training thread reads it only when it asks to wait.
class _Background:
    def __init__(self, path: str, key: str, rank: int, world: int, store: Any, timeout_s: float):
        self.path, self.key, self.rank, self.world = path, key, rank, world
        self.store, self.timeout_s = store, timeout_s
        self.handle: Optional[CheckpointWrite] = None   # rank 0

    def publish(self, handle: CheckpointWrite) -> None:
        """Rank 0's writer thread, when the write ended: its outcome for the other ranks."""
        if self.store is None:
            return
        with contextlib.suppress(Exception):   # a store gone: the others say they could not learn it
            self.store.set(self.key, handle.describe_error() or "ok")

    def outcome(self, bound_s: float) -> Tuple[Optional[str], Optional[str]]:
        """``(error, doubt)``: the write's error (None when it succeeded), or why this rank could
        not learn it (rank 0 gone, no word within ``bound_s``)."""
        if self.rank == 0:
            if self.handle._thread is not None:
                self.handle._thread.join(bound_s)
            if not self.handle.done():
                return f"writing {self.path} did not finish within {bound_s:.0f}s", None
            return self.handle.describe_error(), None
        if self.store is None:
            return None, f"no store to learn from rank 0 whether writing {self.path} succeeded"
        try:
            self.store.wait([self.key], datetime.timedelta(seconds=bound_s))
            text = self.store.get(self.key).decode()
            self.store.add(self.key + "/read", 1)
        except Exception as exc:  # noqa: BLE001 - rank 0 (hosting the store) gone, or no answer in time
            return None, (f"could not learn from rank 0 whether writing {self.path} succeeded "
                          f"({type(exc).__name__}: {exc}); rank 0 reports it; check that file")
        return (None if text == "ok" else f"{text} (on rank 0)"), None

    def let_readers_read(self, bound_s: float) -> None:
        """Rank 0: stay until every other rank has read the outcome (rank 0 may host the store)."""
        if self.rank != 0 or self.store is None or self.world == 1:
            return
        deadline = time.monotonic() + bound_s
        with contextlib.suppress(Exception):
            while self.store.add(self.key + "/read", 0) < self.world - 1 and time.monotonic() < deadline:
                time.sleep(0.05)

    def forget(self) -> None:
        """Rank 0, once every rank is past it: drop its keys from the store."""
        if self.rank == 0 and self.store is not None:
            for k in (self.key, self.key + "/read"):
                with contextlib.suppress(Exception):
                    self.store.delete_key(k)


_background: Optional[_Background] = None   # the last background write nothing reported yet
_linger: Optional[_Background] = None        # rank 0: reported here, the other ranks may still read it
_background_seq: Dict[Tuple[int, ...], int] = {}
_exit_failure: Optional[str] = None   # reported at shutdown: exit non-zero unless something else failed
_uncaught = False                     # an exception reached sys.excepthook: the exit status is already 1
_exit_hook_installed = False
_FAILED_EXIT_STATUS = 1
_SHORT_WAIT_S = 5.0   # on an exception path: the job is failing anyway, do not wait long for peers


def _store_and_timeout():
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (a world of one, a private API moved)
        return None, 600.0
    timeout = getattr(store, "timeout", None)
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 600.0
    with contextlib.suppress(Exception):
        store = store.clone()   # a connection of its own: the writer thread uses it (torch >= 2.5)
    return store, seconds


def _start_background(path: str, group, world: int, rank: int) -> _Background:
    ranks = tuple(dist.get_process_group_ranks(group)) if world > 1 and group is not None else tuple(range(world))
    seq = _background_seq[ranks] = _background_seq.get(ranks, 0) + 1
    store, timeout_s = _store_and_timeout() if world > 1 else (None, 600.0)
    key = f"flodl_opt/checkpoint/{zlib.crc32(repr(ranks).encode()):08x}/{seq}"
    _install_exit_hook()
    return _Background(path, key, rank, world, store, timeout_s)


def wait_checkpoint() -> None:
    """Wait for the background checkpoint write in flight, if any; raise its error.

    On rank 0 it waits for the write itself; on another rank, for rank 0's word on it (through
    the process group's store, bounded by the group's timeout), so any rank may call it.
    """
    global _pending, _background, _linger
    with _pending_lock:
        pending, _pending = _pending, None
    record = _background
    if pending is not None:
        if record is not None and record.handle is pending:
            _background, _linger = None, record   # the others read its outcome when they ask
        pending.wait()
        return
    if record is not None and record.rank != 0:
        _background = None
        error, doubt = record.outcome(record.timeout_s)
        if error is not None or doubt is not None:
            raise CheckpointWriteError(f"flodl_opt: the background checkpoint write failed: {error}"
                                       if error is not None else f"flodl_opt: {doubt}")


def finish_background() -> Optional[str]:
    """Resolve the last background write nothing reported yet: its failure, or None.

    Called by ``flo.shutdown()`` (before the process group goes) and at interpreter exit. Waits
    for rank 0's word (the group's timeout; a few seconds while an exception is propagating).
    """
    global _background, _pending, _linger
    record, lingering = _background, _linger
    _background = _linger = None
    exiting_on_error = sys.exc_info()[0] is not None or _uncaught
    if lingering is not None:
        lingering.let_readers_read(_SHORT_WAIT_S if exiting_on_error else lingering.timeout_s)
    if record is None:
        return None
    if record.rank == 0:
        with _pending_lock:
            if _pending is record.handle:
                _pending = None
    bound = _SHORT_WAIT_S if exiting_on_error else record.timeout_s
    error, doubt = record.outcome(bound)
    record.let_readers_read(bound)
    if doubt is not None:   # not known to have failed: said, but no failure of this process
        with contextlib.suppress(Exception):
            sys.stderr.write(f"flodl_opt: WARNING: {doubt}\n")
    if error is None:
        return None
    return (f"the last background checkpoint write failed and nothing reported it: {error}. The "
            f"checkpoint at {record.path} is the one before it (or none)")


def shutdown_hook() -> None:
    """``flo.shutdown()``: report an unreported failed background write on every rank (raise)."""
    global _exit_failure
    failure = finish_background()
    if failure is not None:
        _exit_failure = failure   # the exit status stays non-zero even if the caller swallows this
        raise CheckpointWriteError(f"flodl_opt: {failure}")


def _note_uncaught(previous):
    def hook(kind, value, tb):
        global _uncaught
        _uncaught = True
        previous(kind, value, tb)
    return hook


def _install_exit_hook() -> None:
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    _exit_hook_installed = True
    sys.excepthook = _note_uncaught(sys.excepthook)
    atexit.register(_report_at_exit)


def _report_at_exit() -> None:
    """At interpreter exit: a failed background write nothing reported is an error, on every rank.

    It prints ``flodl_opt: ERROR: <what failed, the file, the cause>`` on stderr and, unless the
    process already fails (an uncaught exception), ends it with status 1 through ``os._exit``
    after flushing stdout, stderr and logging: the interpreter offers no other way to change the
    exit status at this point. That skips the exit handlers registered before flodl_opt's first
    background save (they would run after this one) and the interpreter's finalization. A script
    that ends with ``sys.exit(n)`` gets status 1 in place of ``n``. Writer threads are not daemons,
    so the write has ended when this runs.
    """
    failure = finish_background() or _exit_failure
    if failure is None:
        return
    with contextlib.suppress(Exception):
        sys.stderr.write(f"flodl_opt: ERROR: {failure}\n")
    if _uncaught:
        return
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(_FAILED_EXIT_STATUS)


# ---------------------------------------------------------------------------- save
def save_checkpoint(path: PathLike, model: nn.Module, opt: LocalSGDOptimizer,
                    extra: Any = None, *, sync: bool = False, background: bool = False,
                    per_rank: bool = True, key: Optional[KeyLike] = None) -> Optional[CheckpointWrite]:
    """Write an exact-resume checkpoint at a consensus point. Collective: every rank calls it.

    Args:
        path: the checkpoint file (replaced atomically; its directory is created).
        model: the model being trained (or its DDP wrapper).
        opt: its LocalSGDOptimizer.
        extra: plain data to restore with it (epoch, step, data position); per rank. Dicts,
            lists, tuples, sets, str, bytes, numbers, None, tensors, numpy arrays: what loads
            without running code. Anything else is a ConfigError (convert it first).
        sync: run ``opt.sync()`` first (a collective) when not called right after a sync.
        background: write from a thread; the loop only pays for a CPU copy. Returns the
            write's handle on rank 0; the next save or ``wait_checkpoint()`` waits for it, and
            a failure nothing reported is reported by ``flo.shutdown()`` or at exit.
        per_rank: keep every rank's inner optimizer state (default). ``False`` keeps rank 0's
            only (smaller file; on resume every rank starts from rank 0's inner state).
        key: a secret (bytes or str): the seal also carries an HMAC-SHA256, so a load with the
            same key refuses a file changed by anyone without it. Pass it on every rank.

    Returns rank 0's :class:`CheckpointWrite` (done unless ``background``), ``None`` elsewhere.

    Raises ConfigError between syncs (``sync=False``) or for an ``extra`` that is not plain data;
    a write that failed raises on every rank; a failed collective raises CheckpointSyncError.
    """
    global _pending, _background, _linger
    path = _check_args(path, model, opt)
    mac_key = _check_key(key)
    if sync:
        opt.sync()
    elif opt.steps_since_sync != 0:
        raise ConfigError(
            f"flodl_opt.save_checkpoint: called {opt.steps_since_sync} step(s) after the last sync, so "
            "the ranks' weights differ. Save right after a sync (when opt.steps_since_sync == 0), or "
            "pass sync=True to sync first (every rank must call it).")
    group, world, rank, src = _group_info(opt)
    what, intact = f"save_checkpoint({path})", "the previous checkpoint is intact"

    # A failed background write must fail every rank, at the next save at the latest.
    previous, error = _background or _linger, None
    if rank == 0:
        try:
            wait_checkpoint()
        except BaseException as exc:  # noqa: BLE001
            error = f"background checkpoint write failed: {type(exc).__name__}: {exc}"
    _background = _linger = None   # its outcome is reported now, on every rank
    copy = background
    sd = opt.state_dict()
    outer = sd[STATE_KEY].pop("outer")
    inner_model = unwrap_model(model)
    replicated_params = getattr(opt.outer, "name", "") != "easgd"   # EASGD ranks keep their own drift
    piece: Dict[str, Any] = {}
    try:
        piece = {"rng": rng_state(), "extra": _plain(extra, copy)}
        if per_rank or rank == 0:
            piece["optimizer"] = _plain(sd, copy, "the optimizer's state_dict")
        if not replicated_params:
            with state_dict_views():  # _plain copies what it must; no second copy of the params
                piece["model"] = _plain(inner_model.state_dict(), copy, "the model's state_dict")
    except ConfigError as exc:
        error = error or f"ConfigError: {exc}"
    errors = _gather_errors(opt, error, group, world, what, intact)
    if previous is not None:
        previous.forget()
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad and not any(e.startswith("ConfigError") for _, e in bad):
        raise RuntimeError(f"flodl_opt.save_checkpoint: {bad[0][1]}; {intact}")
    _raise_bad(errors, "save_checkpoint", world)
    if world > 1:
        pieces: Optional[List[Any]] = [None] * world if rank == 0 else None
        _collective(opt, what, intact, dist.gather_object, piece, pieces, dst=src, group=group)
    else:
        pieces = [piece]

    record = _start_background(path, group, world, rank) if background else None
    handle = None
    if rank == 0:
        with state_dict_views():
            model_sd = inner_model.state_dict() if replicated_params else None
        payload = {
            "format": FORMAT, "version": _KEYED_VERSION if mac_key is not None else FORMAT_VERSION,
            "world_size": world, "time": time.time(), "replicated_params": replicated_params,
            "model": _plain(model_sd, copy, "the model's state_dict") if model_sd is not None else None,
            "outer": _plain(outer, copy, "the outer optimizer's state_dict"),
            "ranks": pieces,
        }
        handle = CheckpointWrite(path, payload, background, key=mac_key,
                                 on_done=record.publish if record is not None else None)
        if record is not None:
            record.handle = handle
            with _pending_lock:
                _pending = handle
    if record is not None:
        _background = record
    if not background:
        error = handle.describe_error() if rank == 0 else None
        _agree_from_root(opt, error, group, world, src, what, intact)
    return handle


def _agree_from_root(opt: LocalSGDOptimizer, error: Optional[str], group, world: int, src: int,
                     what: str, state: str) -> None:
    """Rank 0's verdict, raised on every rank alike."""
    if world > 1:
        box = [error]
        _collective(opt, what, state, dist.broadcast_object_list, box, src=src, group=group)
        error = box[0]
    if error is not None:
        raise RuntimeError(f"flodl_opt.save_checkpoint: {error}; the previous checkpoint is intact")


# ---------------------------------------------------------------------------- load
_MISSING = "no file at "


def _unpickle_refusal(exc: BaseException) -> str:
    """The line of torch's weights_only refusal that names the object (e.g. ``posix.system``)."""
    lines = [s.strip() for s in str(exc).splitlines() if s.strip()]
    named = [s for s in lines if "GLOBAL" in s or "nsupported" in s]
    return (named or lines or [type(exc).__name__])[0][:300]


def _read_payload(path: str, key: Optional[bytes], weights_only: bool) -> Tuple[Any, Optional[str]]:
    """(payload, None) for a file that may be loaded, else (None, why not). Runs no code from a
    file unless ``weights_only`` is False."""
    if not os.path.exists(path):
        return None, _MISSING + path
    if not zipfile.is_zipfile(path):
        return None, (f"{path} cannot be read: it is not a zip archive (torch.save's format), so not a "
                      "checkpoint save_checkpoint wrote; refused without unpickling it")
    damage = _check_seal(path, key)
    if key is not None and damage == "unsealed":
        damage = "it carries no seal, so no HMAC: it cannot be verified with your key"
    if damage is not None and "HMAC" in damage:
        return None, f"{path} is refused: {damage}. Nothing in it was loaded"
    if damage not in (None, "unsealed"):
        return None, (f"{path} is damaged: {damage}; it is not the file save_checkpoint wrote. Resume "
                      "from an earlier checkpoint, or copy the file again")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if not weights_only:
            raise
        return None, (f"{path} is refused: it holds objects other than tensors and plain data "
                      f"({_unpickle_refusal(exc)}), and unpickling them could run any code; nothing "
                      "in it was run or loaded. save_checkpoint never writes such a file: if you "
                      "wrote this one yourself (an older flodl_opt with objects in extra) and trust "
                      "it, load it with trusted=True")
    if not (isinstance(payload, dict) and payload.get("format") == FORMAT):
        return None, (f"{path} is not a flodl_opt checkpoint (written by flo.save_checkpoint); load "
                      "plain state dicts with model.load_state_dict / opt.load_state_dict")
    version = payload.get("version", 0)
    if not isinstance(version, int) or version > _KEYED_VERSION:
        return None, (f"{path} has checkpoint format version {version}, newer than this flodl_opt "
                      f"understands ({_KEYED_VERSION}); upgrade flodl_opt")
    if damage == "unsealed" and version >= 2:
        return None, (f"{path} is damaged: its checksum seal is missing or altered (version {version} "
                      "files are sealed when written). Resume from an earlier checkpoint, or copy the "
                      "file again")
    return _unplain(payload), None


def _check_model(module: nn.Module, model_sd: Any) -> None:
    """Raise ConfigError unless ``module.load_state_dict(model_sd)`` would take every entry."""
    if not isinstance(model_sd, dict):
        raise ConfigError("the checkpoint was saved for a different model (it holds no model state "
                          "dict); build the same model before loading it")
    with state_dict_views():
        ours = module.state_dict()
    missing = [k for k in ours if k not in model_sd]
    unexpected = [k for k in model_sd if k not in ours]
    shapes = [f"{k}: {tuple(model_sd[k].shape)} saved, {tuple(v.shape)} here" for k, v in ours.items()
              if k in model_sd and torch.is_tensor(v) and torch.is_tensor(model_sd[k])
              and model_sd[k].shape != v.shape]
    if missing or unexpected or shapes:
        parts = [f"missing keys {missing[:5]}" if missing else "",
                 f"unexpected keys {unexpected[:5]}" if unexpected else "",
                 f"other shapes ({'; '.join(shapes[:5])})" if shapes else ""]
        raise ConfigError(f"the checkpoint was saved for a different model ({', '.join(p for p in parts if p)}); "
                          "build the same model before loading it")


def load_checkpoint(path: PathLike, model: nn.Module, opt: LocalSGDOptimizer, *, strict: bool = True,
                    missing_ok: bool = False, restore_rng: bool = True,
                    weights_only: Optional[bool] = None, trusted: bool = False,
                    key: Optional[KeyLike] = None) -> Any:
    """Restore a checkpoint written by :func:`save_checkpoint` on every rank; return this rank's extra.

    Collective: every rank calls it (each reads the file: put it where every rank sees it).
    Everything is checked on every rank before anything is written; a refused checkpoint
    (damaged, crafted, another model or config on any rank) leaves the model, the optimizer and
    its counters untouched on every rank.

    Args:
        strict: the optimizer's config must match the saved one (``False`` allows a new
            sync_every / gamma / warmup_steps).
        missing_ok: return ``None`` on every rank when no checkpoint exists yet (a fresh start).
        restore_rng: restore torch / CUDA / numpy / python RNG states (rank r gets rank r's;
            a rank the saved world did not have keeps its own).
        trusted: unpickle arbitrary objects (``torch.load(weights_only=False)``), for a file you
            wrote with an older flodl_opt whose ``extra`` held objects. Unpickling can run any
            code the file names: only for files nobody else could have written. Warns.
        weights_only: ``False`` is ``trusted=True``; the default (``None``/``True``) loads
            tensors and plain data only, which runs no code from the file.
        key: the secret the file was saved with: its HMAC must verify, else it is refused. The
            CRC32 seal of every file detects damage only, not tampering.

    Same world size: each rank gets its own inner optimizer state, counters, RNG and extra.
    Different world size: replicated state (model, outer state) as saved, and every rank takes
    rank 0's inner optimizer state, counters and extra.
    """
    path = _check_args(path, model, opt)
    mac_key = _check_key(key)
    if weights_only is True and trusted:
        raise ConfigError("load_checkpoint: trusted=True unpickles arbitrary objects, weights_only=True "
                          "forbids it: pass one of them")
    unsafe = trusted or weights_only is False
    if unsafe:
        warnings.warn(f"flodl_opt.load_checkpoint({path!r}, trusted=True): unpickling without "
                      "weights_only runs any code the file names (arbitrary code execution); load "
                      "only files you wrote, and save them again to make them safe to load",
                      UnsafeCheckpointWarning, stacklevel=2)
    group, world, rank, _ = _group_info(opt)
    what, untouched = f"load_checkpoint({path})", "nothing was loaded"
    payload, error = None, None
    try:
        payload, error = _read_payload(path, mac_key, not unsafe)
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file: say so on every rank
        error = (f"{path} cannot be read ({type(exc).__name__}: {exc}); it is not a complete "
                 "checkpoint (flo.save_checkpoint never leaves a torn file at its path)")
    statuses = _gather_errors(opt, error, group, world, what, untouched)
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

    # Check everything on every rank; write only if every rank passed.
    label = f"loading checkpoint {path}"
    plan = _everywhere(opt, group, world, what, untouched, label,
                       lambda: _plan_load(payload, model, opt, rank, world, strict, restore_rng))
    _everywhere(opt, group, world, what, "this rank may be partly loaded", label,
                lambda: _apply_load(model, opt, *plan, strict=strict))   # passed every check
    return plan[-1]


def _everywhere(opt: LocalSGDOptimizer, group, world: int, what: str, state: str, label: str,
                fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank; if it raised on any rank, every rank raises (a world of one: as is)."""
    if world == 1:
        return fn()
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    _raise_bad(_gather_errors(opt, error, group, world, what, state), label, world)
    return result


def _plan_load(payload: Dict[str, Any], model: nn.Module, opt: LocalSGDOptimizer, rank: int, world: int,
               strict: bool, restore_rng: bool):
    """What this rank would load, checked; raises (ConfigError for a mismatch) and writes nothing."""
    saved_world = payload["world_size"]
    pieces = payload["ranks"]
    mine = pieces[rank] if saved_world == world else pieces[0]
    opt_piece = mine.get("optimizer") or pieces[0]["optimizer"]
    model_sd = payload["model"] if payload["replicated_params"] else mine["model"]
    _check_model(unwrap_model(model), model_sd)
    sd = dict(opt_piece)
    sd[STATE_KEY] = dict(sd[STATE_KEY], outer=payload["outer"])
    opt.check_state_dict(sd, strict=strict)
    rng = pieces[rank]["rng"] if restore_rng and rank < saved_world else None
    if rng is not None:
        _check_rng_state(rng)
    return model_sd, sd, rng, mine["extra"]


def _apply_load(model: nn.Module, opt: LocalSGDOptimizer, model_sd, sd, rng, extra, *, strict: bool) -> None:
    unwrap_model(model).load_state_dict(model_sd)
    opt.load_state_dict(sd, strict=strict)
    if rng is not None:
        set_rng_state(rng)
