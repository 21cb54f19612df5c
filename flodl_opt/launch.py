"""Launch discovery: who am I, how many are we, and the process group that joins us.

``init()`` reads the rank and world size that the launcher left in the environment
(torchrun, Open MPI, MPICH / Intel MPI, Slurm, or none: plain ``python`` is a world of one),
picks NCCL on CUDA machines and Gloo elsewhere, and creates the default process group.
A world of one creates no process group at all, so single-process scripts pay nothing.

Example::

    import flodl_opt as flo
    flo.init()
    print(f"rank {flo.rank()} of {flo.size()} on {flo.device()}")
"""
from __future__ import annotations

import atexit
import datetime
import hashlib
import os
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .errors import ConfigError

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)

# (launcher name, rank, size, local rank, local size) variables, in the order they are tried.
# torchrun comes first: it may itself run inside an MPI or Slurm allocation.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str
    rank: int
    size: int
    local_rank: int
    local_size: int


@dataclass
class _World:
    info: LaunchInfo
    backend: str
    device: torch.device
    owns_group: bool


_world: Optional[_World] = None
_EXIT_GRACE_S = 0.1


def _exit_grace() -> None:
    """Release the GIL for a moment before the interpreter finalizes.

    A Gloo worker thread frees a finished collective's tensors just after the caller's ``wait()``
    returns, and needs the GIL for that when it holds the last reference to a Python tensor (a
    temporary passed to ``all_reduce``). The group outlives ``destroy_process_group`` while an
    optimizer still holds it, so its threads run on into finalization; one that asks for the GIL
    then is ended inside C++ and the process aborts ("terminate called without an active
    exception", signal 6) after all its work is done. atexit handlers run before finalization.
    """
    time.sleep(_EXIT_GRACE_S)


def _int(env, name: str, default: Optional[int] = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise RuntimeError(f"flodl_opt.init: launcher variable {name} is missing")
        return default
    # Slurm writes SLURM_NTASKS_PER_NODE as "4" or "4(x2)" or "4,2": the first count is ours
    # only on homogeneous allocations, which is what the local size is used for (thread count).
    head = raw.split("(")[0].split(",")[0]
    try:
        return int(head)
    except ValueError:
        raise RuntimeError(f"flodl_opt.init: {name}={raw!r} is not an integer") from None


def discover(env=None) -> LaunchInfo:
    """Read rank, size, local rank and local size from the launcher's environment.

    Returns a world of one when no launcher variables are set (plain ``python``).
    """
    env = os.environ if env is None else env
    for name, r, s, lr, ls in _LAUNCHERS:
        if r in env and s in env:
            rank, size = _int(env, r), _int(env, s)
            local_rank = _int(env, lr, default=rank)
            local_size = _int(env, ls, default=size)
            if name == "slurm" and "SLURM_STEP_NUM_TASKS" in env:
                size = _int(env, "SLURM_STEP_NUM_TASKS")
            if not 0 <= rank < size:
                raise RuntimeError(f"flodl_opt.init: {name} rank {rank} is outside world size {size}")
            return LaunchInfo(name, rank, size, local_rank, local_size)
    return LaunchInfo("python", 0, 1, 0, 1)


def _rendezvous_env(info: LaunchInfo) -> None:
    """Fill MASTER_ADDR / MASTER_PORT for launchers that do not set them (MPI, Slurm)."""
    if info.launcher == "torchrun":
        return
    if "MASTER_ADDR" not in os.environ:
        # Slurm sets SLURM_NTASKS_PER_NODE only under --ntasks-per-node (the local size then
        # defaults to the world size): trust its node count instead.
        nodes = (os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES")
                 if info.launcher == "slurm" else None)
        if (int(nodes) == 1) if nodes else info.local_size >= info.size:  # every rank on this node
            os.environ["MASTER_ADDR"] = "127.0.0.1"
        else:
            addr = _master_addr_over_mpi()
            if addr is None:
                raise RuntimeError(
                    f"flodl_opt.init: {info.launcher} runs {info.size} ranks across several nodes but "
                    "MASTER_ADDR is not set. Export MASTER_ADDR=<rank 0's host> (and MASTER_PORT) "
                    "to every rank, e.g. `mpirun -x MASTER_ADDR=node0 ...`, or install mpi4py so "
                    "rank 0's address can be broadcast over MPI.")
            os.environ["MASTER_ADDR"] = addr
    if "MASTER_PORT" not in os.environ:
        # Every rank of one job must agree on the port without talking: derive it from the job id.
        # (Open MPI 4, then PMIx launchers such as Open MPI 5; MPICH's PMI_ID is per rank, so
        # MPICH falls back to a fixed key: same port on every rank, one such job per node.)
        slurm = os.environ.get("SLURM_JOB_ID")
        job = (os.environ.get("OMPI_MCA_ess_base_jobid") or os.environ.get("PMIX_NAMESPACE")
               or (f"{slurm}.{os.environ.get('SLURM_STEP_ID', '')}" if slurm else None) or "flodl")
        digest = int(hashlib.sha1(job.encode()).hexdigest()[:8], 16)
        lo, hi = _port_window()
        os.environ["MASTER_PORT"] = str(lo + digest % (hi - lo))


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _port_window(path: str = _EPHEMERAL_RANGE) -> "tuple[int, int]":
    """Ports ``[lo, hi)`` to derive a job's MASTER_PORT from: outside the kernel's ephemeral range,
    which outgoing connections take (one of them holding the port fails rank 0 with EADDRINUSE).

    10000-32767 under Linux's default range (32768-60999) and where it cannot be read; below or
    above another range, wherever at least 1000 ports are free of it. Nodes whose ranges differ may
    derive different ports: set MASTER_PORT there.
    """
    lo, hi = 10000, 32768
    try:
        with open(path) as f:
            first, last = (int(v) for v in f.read().split()[:2])
    except (OSError, ValueError):
        return lo, hi
    if first - lo >= 1000:
        return lo, min(hi, first)
    if 65536 - (last + 1) >= 1000:
        return last + 1, 65536
    return lo, hi  # no room outside the range: keep the default window


def _master_addr_over_mpi() -> Optional[str]:
    try:
        from mpi4py import MPI  # optional: only for multi-node MPI launches without MASTER_ADDR
    except ImportError:
        return None
    addr = socket.gethostbyname(socket.gethostname()) if MPI.COMM_WORLD.Get_rank() == 0 else None
    return MPI.COMM_WORLD.bcast(addr, root=0)


def _set_cpu_threads(info: LaunchInfo) -> None:
    """Give each CPU rank its share of the physical cores, so co-located ranks do not fight."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import psutil

    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    try:
        cores = min(cores, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        pass
    torch.set_num_threads(max(1, cores // max(1, info.local_size)))


def init(backend: Optional[str] = None, timeout: Optional[datetime.timedelta] = None,
         set_cpu_threads: bool = True) -> None:
    """Discover the launch and join the process group. Idempotent.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; default NCCL when CUDA is available, else Gloo.
        timeout: how long a collective may wait for its peers before it fails
            (default 10 minutes). A sync stuck on a dead peer raises after this long.
        set_cpu_threads: on CPU ranks without ``OMP_NUM_THREADS``, set torch's thread count to
            physical cores / local ranks.

    If ``torch.distributed`` is already initialized (for example by a DDP script), its default
    group is adopted as is.
    """
    global _world
    if _world is not None:
        return
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"flodl_opt.init: timeout must be a datetime.timedelta or seconds (a number), "
                            f"got {type(timeout).__name__} {timeout!r}; e.g. init(timeout=300)")
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout is not None and timeout.total_seconds() <= 0:
        raise ValueError(f"flodl_opt.init: timeout must be positive, got {timeout}; e.g. init(timeout=300)")
    if dist.is_available() and dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
        found = discover()
        local_rank = found.local_rank if found.size == size else rank
        local_size = found.local_size if found.size == size else size
        info = LaunchInfo(found.launcher if found.size == size else "external",
                          rank, size, local_rank, local_size)
        backend = dist.get_backend()
        owns = False
    else:
        info = discover()
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        owns = info.size > 1
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"flodl_opt.init: backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("flodl_opt.init: backend='nccl' needs CUDA; use backend='gloo' on CPU")
        device = torch.device("cuda", info.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if set_cpu_threads:
            _set_cpu_threads(info)
    if owns:
        _rendezvous_env(info)
        store = _restart_isolated_store(info, timeout or DEFAULT_TIMEOUT)
        if store is not None:
            dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.size,
                                    timeout=timeout or DEFAULT_TIMEOUT)
        else:
            dist.init_process_group(backend, init_method="env://", rank=info.rank,
                                    world_size=info.size, timeout=timeout or DEFAULT_TIMEOUT)
    if backend == "gloo" and info.size > 1:
        # whoever made the group: the optimizers hold it (see _exit_grace); once per process
        atexit.unregister(_exit_grace)
        atexit.register(_exit_grace)
    _world = _World(info, backend, device, owns)


def _restart_isolated_store(info: LaunchInfo, timeout: datetime.timedelta):
    """Under ``torchrun --max-restarts``, a store namespace of its own for each restart.

    torchrun's agent keeps ONE key-value store for all restarts and hands it to the workers
    without a per-restart prefix, so a restarted rank can read the address a dead rank of the
    previous attempt published and fail to connect (PyTorch issue 135712). Prefixing the keys
    with the restart count, which torchrun gives every worker alike, keeps the attempts apart.
    """
    if info.launcher != "torchrun" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    tcp = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.size,
                        is_master=False, timeout=timeout)
    return dist.PrefixStore(f"flodl_opt/restart{restart}/", tcp)


def shutdown() -> None:
    """Leave the process group that ``init()`` created (a no-op if none).

    First it waits for a background checkpoint write nothing has reported yet; if that write
    failed, every rank raises ``CheckpointWriteError`` (naming the file and the cause) once the
    group is gone, and the process exits non-zero even if the caller swallows it.
    """
    global _world
    from .checkpoint import CheckpointWriteError, shutdown_hook
    failure: Optional[CheckpointWriteError] = None
    try:
        shutdown_hook()  # needs the group's store: before the group goes
    except CheckpointWriteError as exc:
        failure = exc
    if _world is not None and _world.owns_group and dist.is_initialized():
        from .stall import close_all
        close_all()  # their threads use the group's store, which goes away with the group
        dist.destroy_process_group()
    _world = None
    if failure is not None:
        raise failure


def is_initialized() -> bool:
    return _world is not None


def _require() -> _World:
    if _world is None:
        raise RuntimeError("flodl_opt is not initialized: call flodl_opt.init() first, on every rank")
    return _world


def rank() -> int:
    return _require().info.rank


def size() -> int:
    return _require().info.size


def local_rank() -> int:
    return _require().info.local_rank


def local_size() -> int:
    return _require().info.local_size


def device() -> torch.device:
    """The device this rank computes on: ``cuda:local_rank`` under NCCL, else CPU."""
    return _require().device


def backend() -> str:
    return _require().backend


def launch_info() -> LaunchInfo:
    return _require().info


def ensure_init() -> None:
    """Initialize implicitly only where that cannot be wrong: a world of one.

    A launcher that started several ranks needs an explicit ``init()`` on every rank (as
    Horovod does), so a forgotten call fails loudly instead of training N unsynced copies.
    """
    if _world is not None:
        _check_still_alone()
        return
    if dist.is_available() and dist.is_initialized():
        init()
        return
    info = discover()
    if info.size > 1:
        raise RuntimeError(
            f"flodl_opt is not initialized: this is rank {info.rank} of {info.size} ({info.launcher}); "
            "call flodl_opt.init() on every rank before building a flodl_opt optimizer")
    init()


def _check_still_alone() -> None:
    """``init()`` saw a world of one, but this process has since become one rank of several.

    Frameworks with their own launcher (Lightning, Accelerate) set the launcher variables and
    create the process group after a script's first lines ran: a ``flo.init()`` there sees a
    world of one, and its optimizer would never sync. A process group created since is adopted;
    launcher variables without one are an error, not N ranks training alone.
    """
    global _world
    if _world is None or _world.info.size != 1 or _world.owns_group:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        warnings.warn(f"flodl_opt: init() ran in a world of one; adopting the process group created "
                      f"since ({dist.get_world_size()} ranks). Under a framework's launcher, drop the "
                      "early flo.init(): flodl_opt adopts the framework's process group by itself.",
                      stacklevel=4)
        _world = None
        init()
        return
    found = discover()
    if found.size > 1:
        raise ConfigError(
            f"flodl_opt: init() ran when this process was a world of one, but {found.launcher}'s "
            f"variables now make it rank {found.rank} of {found.size}, with no process group yet: "
            "its optimizer would train this rank alone. Call flo.init() after the launcher has "
            "started the ranks; under Lightning or Accelerate drop flo.init() and build the "
            "optimizer after the framework set up distributed training (configure_optimizers, "
            "after Accelerator()): flodl_opt adopts its process group.")
