"""Run Horovod's own PyTorch test file against flodl_opt, one launch per test, and classify the result.

Horovod users switch by renaming the import, so Horovod's ``test/parallel/test_torch.py`` is a fair
acceptance test. This tool does not ship that file: point it at a Horovod git checkout (``--horovod``;
the file is read from ``--rev``, default ``HEAD``, with ``git show``, and the commit is recorded) or at
a copy of the file (``--test-file``; the sdist on PyPI does not include the tests).

In a scratch directory it writes a ``horovod.torch`` that re-exports ``flodl_opt`` and a small
``common.py`` with the three helpers the file imports, then runs every test in a launch of its own:
``--np`` fresh rank processes (torchrun's environment variables, a new port each launch), each
running pytest on that one test, all killed at ``--test-timeout`` seconds. So a crash, a hang or a
rank left behind by one test cannot touch the next. The ranks are forked from the tool's process,
which imported torch once (no rank has run anything before), so a launch costs no import time.
Every collective also has a timeout (``--collective-timeout``).

Each test ends as ``pass`` (every rank passed), ``skip`` (skipped by the file itself: no GPU, wrong
controller, ...) or ``fail`` (a rank failed, crashed or ran out of time). Every failure is classified:

* ``unclaimed feature``: what flodl_opt does not claim to have (process sets, alltoall,
  reducescatter, Adasum, Horovod's sparse allreduce, ...): a name the API lacks, a ``ConfigError``
  saying "not supported", or a test listed in ``KNOWN`` as such;
* ``harness artefact``: the test fails on something other than flodl_opt (a change in torch since
  the test was written, a bug of the test itself), listed in ``KNOWN`` with the reason;
* ``real bug``: everything else, until shown otherwise.

Prints a table, writes JSON (``--json``). Run::

    python tools/horovod_compat.py --horovod ~/src/horovod                 # HEAD's test_torch.py, 2 ranks
    python tools/horovod_compat.py --test-file test_torch.py -k allreduce --np 3
    python tools/horovod_compat.py --horovod ~/src/horovod --controller gloo   # as horovodrun --gloo

Horovod's file is run as it is, except that ``inspect.getargspec`` (gone since Python 3.11) is
restored for it.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHIM = '''"""horovod.torch -> flodl_opt (written by tools/horovod_compat.py)."""
import os as _os
import flodl_opt as _flo
from flodl_opt import *  # noqa: F401,F403
from flodl_opt import shutdown, is_initialized, rank, size, local_rank, local_size  # noqa: F401


def init(*args, **kwargs):
    kwargs.setdefault("timeout", float(_os.environ.get("FLODL_COMPAT_COLLECTIVE_TIMEOUT", "30")))
    return _flo.init(*args, **kwargs)
'''

COMMON = '''"""The three helpers Horovod's test file imports from its test/utils/common.py (own versions)."""
import contextlib
import os
import tempfile


def mpi_env_rank_and_size():
    # the launcher's rank and size (tools/horovod_compat.py sets torchrun's variables)
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def skip_or_fail_gpu_test(test, message):
    test.skipTest(message)


@contextlib.contextmanager
def temppath():
    fd, path = tempfile.mkstemp()
    os.close(fd)
    try:
        yield path
    finally:
        if os.path.exists(path):
            os.remove(path)
'''

# Horovod's file predates Python 3.11, which removed inspect.getargspec; restore it (as
# getfullargspec, which has the same .args) so those tests reach flodl_opt instead of failing in
# Python. Nothing else about the test file is changed.
CONFTEST = '''"""Restores what Horovod's test file needs from older Pythons (written by tools/horovod_compat.py)."""
import inspect

if not hasattr(inspect, "getargspec"):
    inspect.getargspec = inspect.getfullargspec
'''

PLUGIN = '''"""Each rank appends its verdict on the test at once (written by tools/horovod_compat.py)."""
import json
import os


def pytest_runtest_logreport(report):
    if report.when != "call" and report.passed:
        return
    if report.when == "teardown" and not report.failed:
        return
    if report.skipped:
        state = "skip"
        msg = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    elif report.failed:
        state = "fail"
        lines = [l[1:].strip() for l in report.longreprtext.splitlines() if l.startswith("E ")]
        msg = " | ".join(lines[:3]) if lines else report.longreprtext.strip().splitlines()[-1]
    else:
        state, msg = "pass", ""
    with open(os.environ["FLODL_COMPAT_REPORT"], "a") as f:
        f.write(json.dumps({"when": report.when, "state": state, "msg": msg[:400]}) + "\\n")
'''

UNCLAIMED, ARTEFACT, BUG = "unclaimed feature", "harness artefact", "real bug"

# Tests whose failure was read and explained (test name -> (category, why)). Anything failing that
# is not here, and not a missing name or a "not supported" refusal, counts as a real bug.
KNOWN: Dict[str, Tuple[str, str]] = {
    "test_delta_optimizer": (UNCLAIMED, "Adasum (op=hvd.Adasum raises ConfigError)"),
    "test_sparse_embeddings": (UNCLAIMED, "DistributedOptimizer(sparse=True): Horovod's sparse allreduce"),
    "test_async_sparse_allreduce": (UNCLAIMED, "sparse_allreduce_async: Horovod's sparse allreduce"),
    "test_broadcast_state": (ARTEFACT, "the loop over every torch.optim.Optimizer subclass meets "
                                       "torch.optim.Muon (newer than the test), whose constructor "
                                       "refuses 1-D parameters"),
    "test_broadcast_state_options": (ARTEFACT, "the same loop over every optimizer meets torch.optim.Muon"),
    "test_force_allreduce": (ARTEFACT, "the same loop over every optimizer meets torch.optim.Muon"),
    # Horovod pairs collectives by name: rank 0 starts "duplicate_name", both ranks enter a barrier,
    # then rank 1 starts its own; here collectives pair by call order (documented), so rank 0's
    # allreduce meets rank 1's barrier and both raise CollectiveMismatchError at once
    "test_horovod_allreduce_duplicate_name_error": (UNCLAIMED, "matching by name across a barrier "
                                                               "(collectives pair by call order here)"),
    "test_horovod_allgather_duplicate_name_error": (UNCLAIMED, "matching by name across a barrier "
                                                               "(collectives pair by call order here)"),
    "test_horovod_broadcast_duplicate_name_error": (UNCLAIMED, "matching by name across a barrier "
                                                               "(collectives pair by call order here)"),
}
# Whole families flodl_opt does not claim (README): the test name says which.
_UNCLAIMED_NAMES = re.compile(r"process_set|alltoall|reducescatter|adasum")
# A name the API lacks, or a keyword it does not take.
_MISSING = re.compile(r"module 'horovod\.torch' has no attribute '(\w+)'|unexpected keyword argument '(\w+)'|"
                      r"cannot import name '(\w+)'|has no attribute '(add_process_set|remove_process_set|"
                      r"ProcessSet|global_process_set)'")


def test_names(source: str) -> List[str]:
    """``Class::test_x`` for every test method, read with ast (the file is not imported here)."""
    out: List[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            out += [f"{node.name}::{f.name}" for f in node.body
                    if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
    # A name defined twice in a class is one test (the later definition wins, as in Python).
    return list(dict.fromkeys(out))


def read_test_file(args) -> Tuple[str, Optional[str]]:
    """(source, commit) of Horovod's test file: from a git checkout at ``--rev``, or a copy."""
    if args.test_file:
        return open(args.test_file).read(), None
    git = ["git", "-C", args.horovod] if os.path.isdir(os.path.join(args.horovod, ".git")) else \
        ["git", f"--git-dir={args.horovod}"]
    commit = subprocess.run(git + ["rev-parse", args.rev], capture_output=True, text=True, check=True).stdout.strip()
    source = subprocess.run(git + ["show", f"{commit}:test/parallel/test_torch.py"], capture_output=True,
                            text=True, check=True).stdout
    return source, commit


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _verdict(path: str) -> Tuple[str, str]:
    """One rank's (state, message): the first failure wins over a pass, a skip over nothing."""
    if not os.path.exists(path):
        return "crash", "no report (the rank died before pytest reported)"
    recs = [json.loads(line) for line in open(path) if line.strip()]
    for state in ("fail", "skip", "pass"):
        hit = next((r for r in recs if r["state"] == state), None)
        if hit is not None:
            return state, hit["msg"]
    return "crash", "no verdict"


def _start_rank(test: str, scratch: str, env: Dict[str, str], log_path: str) -> int:
    """Fork a rank from this process (torch is already imported: a launch costs no import time)
    and run pytest on ``test`` in it; returns its pid, the leader of its own session."""
    pid = os.fork()
    if pid:
        return pid
    code = 3
    try:
        os.setsid()
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(scratch)
        os.environ.clear()
        os.environ.update(env)
        sys.path[:0] = [scratch]
        # pytest rewrites the 4000-line test file's asserts on import (seconds): keep the result,
        # under the scratch folder only, for the next launches
        sys.pycache_prefix = os.path.join(scratch, "pycache")
        sys.dont_write_bytecode = False
        import pytest
        code = int(pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", "-p", "flodl_compat_plugin",
                                f"test_torch.py::{test}"]))
    except BaseException:  # noqa: BLE001 - the exit code says it; the log has the traceback
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_one(test: str, args, scratch: str, base_env: Dict[str, str]) -> Dict:
    """One launch of ``--np`` fresh ranks on one test; every rank killed at the time limit."""
    tag = test.split("::")[-1]
    out_dir = os.path.join(scratch, "reports", tag)
    os.makedirs(out_dir, exist_ok=True)
    port = _free_port()
    t0 = time.monotonic()
    pids = []
    for r in range(args.np):
        env = dict(base_env, RANK=str(r), WORLD_SIZE=str(args.np), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(args.np), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   FLODL_COMPAT_REPORT=os.path.join(out_dir, f"rank{r}.jsonl"))
        if args.controller == "gloo":  # Horovod's file tells the Gloo controller by these
            env.update(HOROVOD_RANK=str(r), HOROVOD_SIZE=str(args.np), HOROVOD_LOCAL_RANK=str(r),
                       HOROVOD_LOCAL_SIZE=str(args.np))
        pids.append(_start_rank(test, scratch, env, os.path.join(out_dir, f"rank{r}.log")))
    codes: Dict[int, int] = {}
    deadline = t0 + args.test_timeout
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    timed_out = len(codes) < len(pids)
    for pid in pids:  # each rank leads its own session: kill whatever is left of it
        if pid not in codes:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    ranks = []
    for r, pid in enumerate(pids):
        state, msg = _verdict(os.path.join(out_dir, f"rank{r}.jsonl"))
        code = codes[pid]
        if state == "crash" or (code not in (0, 1) and state == "pass"):
            tail = open(os.path.join(out_dir, f"rank{r}.log")).read().strip().splitlines()[-3:]
            why = f"killed at the {args.test_timeout}s limit" if timed_out and code == -signal.SIGKILL \
                else f"exit code {code}"
            state, msg = "crash", f"{why}: {' | '.join(tail)[:300]}"
        ranks.append((state, msg))
    return {"test": tag, "ranks": ranks, "seconds": round(time.monotonic() - t0, 1), **classify(tag, ranks)}


def classify(test: str, ranks: List[Tuple[str, str]]) -> Dict[str, str]:
    states = [s for s, _ in ranks]
    if all(s == "pass" for s in states):
        return {"result": "pass", "category": "", "message": ""}
    if all(s in ("skip", "pass") for s in states):
        return {"result": "skip", "category": "", "message": next(m for s, m in ranks if s == "skip")}
    msg = next(m for s, m in ranks if s in ("fail", "crash"))
    if test in KNOWN:
        category, why = KNOWN[test]
        return {"result": "fail", "category": category, "message": f"{why} [{msg[:200]}]"}
    if _MISSING.search(msg) or _UNCLAIMED_NAMES.search(test) or ("not supported" in msg and "ConfigError" in msg):
        return {"result": "fail", "category": UNCLAIMED, "message": msg}
    return {"result": "fail", "category": BUG, "message": msg}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--horovod", help="a Horovod git checkout (or bare git dir): its test/parallel/test_torch.py")
    src.add_argument("--test-file", help="a copy of Horovod's test/parallel/test_torch.py")
    p.add_argument("--rev", default="HEAD", help="with --horovod: the commit to read the file from (default HEAD)")
    p.add_argument("--np", type=int, default=2, help="ranks per test (default 2)")
    p.add_argument("-k", default="", help="only tests whose name contains this")
    p.add_argument("--test-timeout", type=int, default=120,
                   help="seconds per launch, startup included (default 120)")
    p.add_argument("--collective-timeout", type=float, default=30.0)
    p.add_argument("--controller", choices=("mpi", "gloo"), default="mpi",
                   help="which Horovod controller the test file should believe it runs under: mpi "
                        "(the default) or gloo (as horovodrun --gloo; adds the shutdown/re-init tests)")
    p.add_argument("--json", default="horovod_compat.json")
    args = p.parse_args()
    source, commit = read_test_file(args)
    names = [t for t in test_names(source) if args.k in t]
    scratch = tempfile.mkdtemp(prefix="flodl_hvd_compat_")
    rows: List[Dict] = []
    t0 = time.monotonic()
    try:
        os.makedirs(os.path.join(scratch, "horovod", "torch"))
        open(os.path.join(scratch, "horovod", "__init__.py"), "w").close()
        files = {"horovod/torch/__init__.py": SHIM, "common.py": COMMON, "conftest.py": CONFTEST,
                 "flodl_compat_plugin.py": PLUGIN, "test_torch.py": source}
        for name, text in files.items():
            with open(os.path.join(scratch, name), "w") as f:
                f.write(text)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_"))}
        # no third-party pytest plugins in the ranks (loading hypothesis alone costs seconds per launch)
        env.update(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                   FLODL_COMPAT_COLLECTIVE_TIMEOUT=str(args.collective_timeout),
                   PYTHONPATH=os.pathsep.join(p for p in [scratch, ROOT, os.environ.get("PYTHONPATH", "")] if p))
        # Imported once here; every rank is forked from this process (see _start_rank).
        sys.path.insert(0, ROOT)
        import numpy, pytest, torch, torch.distributed, flodl_opt  # noqa: F401,E401
        for i, test in enumerate(names, 1):
            row = run_one(test, args, scratch, env)
            rows.append(row)
            eta = (time.monotonic() - t0) / i * (len(names) - i)
            extra = f"  [{row['category']}] {row['message'][:100]}" if row["result"] == "fail" else ""
            print(f"[{i}/{len(names)}] {row['result']:4s} {row['test']} ({row['seconds']}s, "
                  f"ETA {eta:.0f}s){extra}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    counts = {k: sum(1 for r in rows if r["result"] == k) for k in ("pass", "skip", "fail")}
    by_cat = {c: sum(1 for r in rows if r["category"] == c) for c in (UNCLAIMED, ARTEFACT, BUG)}
    where = f"{args.horovod}@{commit[:12]}" if commit else args.test_file
    print(f"\nHorovod test_torch.py ({where}) on {args.np} ranks, {args.controller} controller, one launch "
          f"per test, against flodl_opt: {len(rows)} tests in {time.monotonic() - t0:.0f}s")
    print(f"{'result':22s} {'tests':>5s}")
    for k in ("pass", "skip", "fail"):
        print(f"{k:22s} {counts[k]:5d}")
    for c in (UNCLAIMED, ARTEFACT, BUG):
        print(f"  fail: {c:14s} {by_cat[c]:5d}")
    for c in (BUG, ARTEFACT, UNCLAIMED):
        for r in rows:
            if r["category"] == c:
                print(f"  [{c}] {r['test']}: {r['message'][:160]}")
    with open(args.json, "w") as f:
        json.dump({"horovod_commit": commit, "test_file": None if commit else os.path.abspath(args.test_file),
                   "np": args.np, "controller": args.controller, "test_timeout": args.test_timeout,
                   "collective_timeout": args.collective_timeout, "counts": counts, "fail_categories": by_cat,
                   "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "tests": rows},
                  f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
