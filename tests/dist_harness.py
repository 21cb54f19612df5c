"""Run a function on N real ranks (separate processes, a real Gloo process group).

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, each of which sets the
torchrun-style environment, calls ``flodl_opt.init(timeout=...)`` and returns ``fn(rank, world_size,
*args)``. The results come back in rank order. A rank that raises fails the call with that rank's
own traceback; a rank that does not finish within ``timeout`` seconds gets all ranks killed and
the call fails naming the stuck ranks, so no test can hang CI.

Processes come from a forkserver that has already imported torch, so a rank starts in a fraction
of a second instead of re-importing torch.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from typing import Any, Callable, List, Optional

_CTX = None
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class RankFailure(AssertionError):
    pass


def _context():
    global _CTX
    if _CTX is None:
        # Children must import this module and the test modules by name.
        paths = [HERE, ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "flodl_opt",
                                     "dist_harness"])
    return _CTX


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env() -> dict:
    """The environment for starting a launcher (torchrun, mpirun, a framework's spawn) from a test:
    no rank variables inherited, one thread per rank, CPU only, this checkout importable."""
    env = dict(os.environ)
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(v, None)
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # two ranks on this machine's CPU, even on a one-GPU box
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["MASTER_PORT"] = str(free_port())
    return env


def run_launcher(cmd: List[str], env: dict, cwd: str = ROOT, timeout: float = 240.0) -> str:
    """Run a launcher command to the end (its process tree is killed past ``timeout``); fail the
    test with its output unless it exits 0; return its output."""
    import subprocess
    import pytest
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # the process tree is killed by subprocess.run
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout:.0f}s; output:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}"
    return proc.stdout


def _rank_main(fn, rank, world_size, port, args, queue, init_timeout_s, env):
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    })
    os.environ.update(env or {})
    try:
        import torch
        torch.set_num_threads(1)
        import flodl_opt as flo
        flo.init(backend="gloo", timeout=init_timeout_s)
        result = fn(rank, world_size, *args)
        # Pickled here: tensors put on a queue as-is travel as shared-memory handles that die
        # with this process, and the parent would wait for a result it can never read.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report anything, including SystemExit
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import flodl_opt as flo
            flo.shutdown()
        except Exception:
            pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 60.0,
              collective_timeout: float = 20.0, env: Optional[dict] = None) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the results by rank."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, r, world_size, port, args, queue, collective_timeout, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict = {}
    failures: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 0.5))
            except Exception:  # queue.Empty
                # A rank that died without reporting (segfault, os._exit) would otherwise be waited for.
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in results and r not in failures]
                for r in dead:
                    failures[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting"
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
    if failures:
        text = "\n".join(f"---- rank {r} ----\n{tb}" for r, tb in sorted(failures.items()))
        raise RankFailure(f"{len(failures)} rank(s) failed:\n{text}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise RankFailure(f"ranks {missing} did not finish within {timeout:.0f}s (killed)")
    return [results[r] for r in range(world_size)]


def gather_object(obj: Any) -> List[Any]:
    """Test-side all_gather of a picklable object (independent of the code under test)."""
    import torch.distributed as dist
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


if __name__ == "__main__":  # pragma: no cover
    sys.exit("import me from tests")


def survivor_verdict(fn: Callable, out: str, **kwargs: Any) -> Any:
    """Run ``fn`` on 2 ranks, rank 1 of which SIGKILLs itself; return what rank 0 saved at ``out``.

    Asserts that only rank 1 failed: the survivor must report (through the file), not crash.
    """
    import torch
    try:
        run_ranks(fn, 2, out, **kwargs)
    except RankFailure as exc:
        text = str(exc)
        assert "rank 1 exited with code -9" in text and "---- rank 0" not in text, text
    else:
        raise AssertionError("rank 1 was meant to die, but every rank finished")
    return torch.load(out, weights_only=False)


def sync_error_verdict(out: str, run: Callable[[], Any], describe: Callable[[Exception], dict]) -> dict:
    """Run ``run()`` on the survivor; save (at ``out``) and return ``describe`` of its SyncError."""
    import torch
    import flodl_opt as flo
    try:
        run()
    except flo.SyncError as exc:
        result = describe(exc)
    else:
        result = {"msg": "no error"}
    torch.save(result, out)
    return result



def base_package(tmp_dir, commit: str) -> Optional[str]:
    """``commit``'s flodl_opt, importable as ``flodl_opt_base`` from the returned folder (None where
    git lacks the commit): what a default must still equal bit for bit."""
    import io
    import subprocess
    import tarfile
    try:
        blob = subprocess.run(["git", "-C", ROOT, "archive", commit, "flodl_opt"], check=True,
                              capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(tmp_dir, filter="data")
    os.rename(os.path.join(tmp_dir, "flodl_opt"), os.path.join(tmp_dir, "flodl_opt_base"))
    return str(tmp_dir)


def load_base(base_dir: str):
    """Import the package ``base_package`` extracted (in a rank process)."""
    import importlib
    sys.path.insert(0, base_dir)
    try:
        return importlib.import_module("flodl_opt_base")
    finally:
        sys.path.remove(base_dir)


def run_with_base(fn: Callable, world_size: int, tmp_dir, commit: str, timeout: float = 150.0):
    """``run_ranks(fn, world_size, base_dir)`` with ``commit``'s package extracted for it (or None):
    ``(results, base_dir)``."""
    base = base_package(tmp_dir, commit)
    return run_ranks(fn, world_size, base, timeout=timeout), base


def option_off_runs(base_dir, option: str, run: Callable, diloco_lr: float) -> dict:
    """``run(lib, outer, kw)`` for the option left at its default, set False, and (with ``base_dir``)
    the base commit's package without it; with plain averaging and DiLoCo: ``{(name, outer): result}``.
    DiLoCo gets the base commit's default outer lr explicitly: the default changed after it."""
    import flodl_opt as flo
    out = {}
    for name in ("default", "off", "base"):
        if name == "base" and base_dir is None:
            continue
        lib = load_base(base_dir) if name == "base" else flo
        for outer in (None, "diloco"):
            spec = outer if outer is None else lib.DiLoCo(lr=diloco_lr)
            out[(name, outer)] = run(lib, spec, {option: False} if name == "off" else {})
    return out


def assert_option_off_identical(results: list, base_dir) -> None:
    """Every rank's ``option_off_runs``: the default is bit-identical to the option set False, and
    to the base commit's package where there is one."""
    import numpy as np
    for r in results:
        d = r["defaults"]
        for outer in (None, "diloco"):
            assert all(np.array_equal(x, y) for x, y in zip(d[("default", outer)], d[("off", outer)]))
            if base_dir is not None:
                assert all(np.array_equal(x, y) for x, y in zip(d[("default", outer)], d[("base", outer)]))


def assert_default_identical(results: list, base_dir, commit: str, option: str) -> None:
    """``assert_option_off_identical``, then a skip that says so where git lacks ``commit``."""
    import pytest
    assert_option_off_identical(results, base_dir)
    if base_dir is None:
        pytest.skip(f"git has no commit {commit}: compared the default with {option}=False only")


def load_script(name: str, path: str):
    """A script under tools/ or examples/ as a module: its functions and tables, without running it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
