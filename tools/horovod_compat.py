"""Run Horovod's own PyTorch test file against flodl_opt and count what passes.

Horovod users switch by renaming the import, so Horovod's ``test/parallel/test_torch.py`` is a fair
acceptance test. This tool does not ship that file: pass your copy of it (from a Horovod checkout
or ``https://raw.githubusercontent.com/horovod/horovod/<tag>/test/parallel/test_torch.py``; the
sdist on PyPI does not include the tests). In a
scratch directory it writes a two-line ``horovod.torch`` that re-exports ``flodl_opt`` and a small
``common.py`` with the three helpers the file imports, then runs each test on ``--np`` ranks under
``mpirun`` (as Horovod's CI does): all tests in one launch, then any test that the ranks did not
all report (a crash took the launch down) again in a launch of its own, so a crash costs only that
test. Every test gets a time limit (pytest-timeout) and every collective a timeout.

Each test is reported as ``pass`` (every rank passed), ``skip`` (skipped, e.g. needs a GPU or the
Gloo controller), ``missing`` (fails because the API has no such name: process sets, alltoall,
...), ``refused`` (a ``ConfigError`` saying the feature is not supported), ``fail``, or
``crash``/``timeout``. Prints a table, writes JSON.

Run::

    python tools/horovod_compat.py --test-file ~/horovod/test/parallel/test_torch.py
    python tools/horovod_compat.py --test-file test_torch.py --np 3 -k allreduce --json out.json
    python tools/horovod_compat.py --test-file test_torch.py --controller gloo   # as horovodrun --gloo

Horovod's file is run as it is, except that ``inspect.getargspec`` (gone since Python 3.11) is
restored for it; RELIABILITY.md lists the outcome of every test and why.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

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
    for r, s in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if r in os.environ:
            return int(os.environ[r]), int(os.environ[s])
    return 0, 1


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


PLUGIN = '''"""Each rank appends every test's outcome at once, so a crash loses only the test it hit."""
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
        msg = lines[0] if lines else report.longreprtext.strip().splitlines()[-1]
    else:
        state, msg = "pass", ""
    path = os.environ["FLODL_COMPAT_REPORT"].replace("{rank}", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    with open(path, "a") as f:
        f.write(json.dumps({"test": report.nodeid.split("::")[-1], "state": state, "msg": msg[:200]}) + "\\n")
'''


def test_names(path: str) -> List[str]:
    """``Class::test_x`` for every test method, read with ast (the file is not imported here)."""
    tree = ast.parse(open(path).read())
    out: List[str] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out += [f"{node.name}::{f.name}" for f in node.body
                    if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
    # A name defined twice in a class is one test (the later definition wins, as in Python).
    return list(dict.fromkeys(out))


def _outcomes(path: str) -> Dict[str, Tuple[str, str]]:
    """test name -> (pass/fail/skip, message) from one rank's report (the first verdict wins)."""
    out: Dict[str, Tuple[str, str]] = {}
    if os.path.exists(path):
        for line in open(path):
            rec = json.loads(line)
            if rec["test"] not in out or rec["state"] == "fail":
                out[rec["test"]] = (rec["state"], rec["msg"])
    return out


# Only a name the API lacks counts as missing; "'NoneType' object has no attribute" and the like
# are ordinary failures.
_MISSING = re.compile(r"module 'horovod\.torch' has no attribute '(\w+)'|unexpected keyword argument '(\w+)'|"
                      r"cannot import name '(\w+)'")


def classify(per_rank: List[Tuple[str, str]]) -> Tuple[str, str]:
    states = [s for s, _ in per_rank]
    if all(s == "pass" for s in states):
        return "pass", ""
    if "fail" not in states and "crash" not in states and "skip" in states:
        return "skip", next(m for s, m in per_rank if s == "skip")
    msg = next((m for s, m in per_rank if s in ("fail", "crash")), "")
    if _MISSING.search(msg):
        return "missing", msg
    if "ConfigError" in msg and "not supported" in msg:
        return "refused", msg  # a clear error for a feature flodl_opt does not have
    return ("crash" if "crash" in states and "fail" not in states else "fail"), msg


def run_tests(tests: List[str], args, scratch: str, env: Dict[str, str], tag: str,
              ) -> Tuple[Dict[str, List[Tuple[str, str]]], str]:
    """One mpirun of pytest over ``tests``; per test, every rank's (state, message)."""
    out_dir = os.path.join(scratch, "reports")
    os.makedirs(out_dir, exist_ok=True)
    local = [] if shutil.which("ssh") or shutil.which("rsh") else ["--mca", "plm", "isolated"]
    ids = " ".join(f"'{os.path.join(scratch, 'test_torch.py')}::{t}'" for t in tests)
    # Gloo controller (as ``horovodrun --gloo``): Horovod's file reads HOROVOD_RANK/SIZE to tell it
    # from MPI and then also runs its shutdown/re-init tests.
    gloo = ("HOROVOD_RANK=$OMPI_COMM_WORLD_RANK HOROVOD_SIZE=$OMPI_COMM_WORLD_SIZE "
            "HOROVOD_LOCAL_RANK=$OMPI_COMM_WORLD_LOCAL_RANK HOROVOD_LOCAL_SIZE=$OMPI_COMM_WORLD_LOCAL_SIZE "
            if args.controller == "gloo" else "")
    inner = (f"{gloo}{sys.executable} -m pytest -q -p no:cacheprovider -o addopts='' "
             f"--timeout {args.test_timeout} -p flodl_compat_plugin {ids}")
    env = dict(env, FLODL_COMPAT_REPORT=f"{out_dir}/{tag}.rank{{rank}}.jsonl")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.np), *local,
           "-x", "FLODL_COMPAT_REPORT", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "FLODL_COMPAT_COLLECTIVE_TIMEOUT",
           "-x", "MASTER_PORT", "-x", "CUDA_VISIBLE_DEVICES", "sh", "-c", inner]
    limit = args.test_timeout * len(tests) + 60
    try:
        proc = subprocess.run(cmd, env=env, cwd=scratch, capture_output=True, text=True, timeout=limit)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        log = f"no result within {limit}s"
    reports = [_outcomes(f"{out_dir}/{tag}.rank{r}.jsonl") for r in range(args.np)]
    results = {}
    for t in tests:
        name = t.split("::")[-1]
        if all(name in rep for rep in reports):
            results[t] = [rep[name] for rep in reports]
    return results, log


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--test-file", required=True, help="Horovod's test/parallel/test_torch.py")
    p.add_argument("--np", type=int, default=2, help="ranks per test (default 2)")
    p.add_argument("-k", default="", help="only tests whose name contains this")
    p.add_argument("--test-timeout", type=int, default=120, help="seconds per test (default 120)")
    p.add_argument("--collective-timeout", type=float, default=30.0)
    p.add_argument("--isolated", type=int, default=0,
                   help="1: one launch per test (slow: a launch costs seconds of imports per rank)")
    p.add_argument("--controller", choices=("mpi", "gloo"), default="mpi",
                   help="which Horovod controller the test file should believe it runs under: mpi "
                        "(plain mpirun) or gloo (as horovodrun --gloo; adds the shutdown/re-init tests)")
    p.add_argument("--json", default="horovod_compat.json")
    args = p.parse_args()
    if shutil.which("mpirun") is None:
        sys.exit("mpirun not found: install Open MPI (Debian: apt-get install openmpi-bin)")
    names = [t for t in test_names(args.test_file) if args.k in t]
    scratch = tempfile.mkdtemp(prefix="flodl_hvd_compat_")
    try:
        os.makedirs(os.path.join(scratch, "horovod", "torch"))
        open(os.path.join(scratch, "horovod", "__init__.py"), "w").close()
        with open(os.path.join(scratch, "horovod", "torch", "__init__.py"), "w") as f:
            f.write(SHIM)
        with open(os.path.join(scratch, "common.py"), "w") as f:
            f.write(COMMON)
        with open(os.path.join(scratch, "conftest.py"), "w") as f:
            f.write(CONFTEST)
        with open(os.path.join(scratch, "flodl_compat_plugin.py"), "w") as f:
            f.write(PLUGIN)
        shutil.copy(args.test_file, os.path.join(scratch, "test_torch.py"))
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                   FLODL_COMPAT_COLLECTIVE_TIMEOUT=str(args.collective_timeout),
                   PYTHONPATH=os.pathsep.join([scratch, ROOT, os.environ.get("PYTHONPATH", "")]))
        rows = []
        t0 = time.monotonic()
        done = 0

        def record(test: str, state: str, msg: str) -> None:
            nonlocal done
            done += 1
            rows.append({"test": test.split("::")[-1], "result": state, "message": msg})
            eta = (time.monotonic() - t0) / done * (len(names) - done)
            print(f"[{done}/{len(names)}] {state:8s} {test.split('::')[-1]}  (ETA {eta:.0f}s)"
                  + (f"  {msg[:90]}" if state not in ("pass", "skip") else ""), flush=True)

        def crash_reason(log: str) -> str:
            lines = [l.strip() for l in log.splitlines() if l.strip() and not l.startswith("---")]
            hits = [l for l in lines if re.search(r"signal|Error|Killed|Abort", l)]
            return (hits[-1] if hits else lines[-1] if lines else "no report")[:200]

        # Tests run in one launch (a launch costs seconds of imports per rank). A crash takes the
        # launch down: the first test not reported by every rank then runs alone, and a new launch
        # resumes after it.
        todo, launch = list(names), 0
        while todo:
            batch = todo if not args.isolated else todo[:1]
            env["MASTER_PORT"] = str(29500 + (os.getpid() + launch) % 2000)
            results, log = run_tests(batch, args, scratch, env, f"launch{launch}")
            launch += 1
            reported = 0
            while reported < len(batch) and batch[reported] in results:
                record(batch[reported], *classify(results[batch[reported]]))
                reported += 1
            todo = todo[reported:]
            if todo and reported < len(batch):
                if len(batch) > 1:  # rerun the one that went down with the launch, on its own
                    env["MASTER_PORT"] = str(29500 + (os.getpid() + launch) % 2000)
                    results, log = run_tests(todo[:1], args, scratch, env, f"launch{launch}")
                    launch += 1
                if todo[0] in results:
                    record(todo[0], *classify(results[todo[0]]))
                else:
                    record(todo[0], "timeout" if "no result within" in log else "crash", crash_reason(log))
                todo = todo[1:]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    print(f"\nHorovod test_torch.py on {args.np} ranks ({args.controller} controller) against flodl_opt: "
          f"{len(rows)} tests")
    print(f"{'result':10s} {'tests':>5s}")
    for k in ("pass", "skip", "missing", "refused", "fail", "crash", "timeout"):
        print(f"{k:10s} {counts.get(k, 0):5d}")
    for r in rows:
        if r["result"] in ("fail", "crash", "timeout"):
            print(f"  {r['result']:7s} {r['test']}: {r['message'][:120]}")
    with open(args.json, "w") as f:
        json.dump({"np": args.np, "controller": args.controller, "test_file": os.path.abspath(args.test_file), "counts": counts,
                   "tests": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
