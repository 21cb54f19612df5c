"""Check the CUDA path on a GPU machine: the GPU tests, fence removal, NCCL's limits, benchmarks.

Run from the repository root, with nothing installed beyond torch::

    PYTHONPATH=. python tools/gpu_check.py                      # card + GPU tests
    PYTHONPATH=. python tools/gpu_check.py --negative --nccl-two-ranks --suite \\
        --also "python tools/bench_step.py --device cuda"

What it runs, each in its own process with a timeout:

* the card (``nvidia-smi``), torch, CUDA and NCCL versions;
* ``tests/test_gpu.py``: NCCL PREMUL_SUM against float64 at a world of one (factor on the device),
  bf16/fp16 reduced in float32, ranks sharing the GPU over Gloo with CUDA tensors, and the
  stream-ordering stress against a float64 replay;
* ``--negative``: the stress again with a fence removed on purpose (``FLODL_GPU_BREAK``); each of
  these runs is EXPECTED to fail, which shows that the stress test can fail;
* ``--nccl-two-ranks``: whether NCCL accepts two ranks on one GPU (it is expected to refuse);
* ``--suite``: the rest of the test suite (multi-process tests over Gloo) under this torch;
* ``--also CMD``: any further command (benchmarks), its output kept in the log.

It prints a table last and writes ``gpu_check.json`` (and the log, when ``$OUT`` or ``--out`` is set).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _run(name: str, cmd: List[str], timeout: float, extra_env: Optional[Dict[str, str]] = None) -> dict:
    """Run one step, echo its output, and return rc, wall time and the output's last lines."""
    print(f"\n===== {name}: {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=_env(extra_env), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=timeout)
        out, rc = p.stdout.decode(errors="replace"), p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.output or b"").decode(errors="replace") + f"\n[timed out after {timeout:.0f}s]", 124
    print(out, flush=True)
    return {"name": name, "cmd": cmd, "rc": rc, "s": round(time.time() - t0, 1),
            "tail": out.strip().splitlines()[-40:]}


def _pytest_summary(res: dict) -> str:
    for line in reversed(res["tail"]):
        if re.search(r"\d+ (passed|failed|error|skipped)", line):
            return line.strip("= ")
    return f"rc={res['rc']}"


def card_info() -> dict:
    import torch
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(),
            "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001
        info["nccl"] = f"unavailable: {e}"
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                            "--format=csv,noheader"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=30)
        info["nvidia_smi"] = q.stdout.decode().strip().splitlines()
        full = subprocess.run(["nvidia-smi"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
        print(full.stdout.decode(), flush=True)
    except Exception as e:  # noqa: BLE001
        info["nvidia_smi"] = [f"nvidia-smi failed: {e}"]
    if info["cuda_available"]:
        info["name"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        # What LocalSGDOptimizer.step() pays to remember the training stream, next to the public call.
        import timeit
        torch.cuda.init()
        n = 200_000
        key = timeit.timeit(lambda: torch._C._cuda_getCurrentStream(0), number=n) / n * 1e6
        full_stream = timeit.timeit(lambda: torch.cuda.current_stream(0), number=n) / n * 1e6
        info["stream_key_us"], info["current_stream_us"] = round(key, 3), round(full_stream, 3)
    print(json.dumps(info, indent=1), flush=True)
    return info


# ------------------------------------------------------------------ NCCL with two ranks on one GPU
def _nccl_two_ranks_child(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.full((4,), float(rank + 1), device="cuda:0")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print(f"rank {rank}: all_reduce gave {t.tolist()} (expected [3.0]*4)", flush=True)
    dist.destroy_process_group()


def nccl_two_ranks(timeout: float = 120.0) -> dict:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"\n===== nccl-two-ranks: 2 NCCL ranks on cuda:0 (port {port})", flush=True)
    env = _env({"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    procs = [subprocess.Popen([sys.executable, __file__, "--_nccl-child", str(r), str(port)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs, rcs = [], []
    deadline = time.time() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
            rc = p.returncode
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            rc = 124
        outs.append(out.decode(errors="replace"))
        rcs.append(rc)
    for r, o in enumerate(outs):
        print(f"--- rank {r} (rc {rcs[r]})\n{o}", flush=True)
    errors = [line.strip() for o in outs for line in o.splitlines()
              if re.search(r"(Error|error|Duplicate|invalid usage|refus)", line)]
    verdict = "works" if all(rc == 0 for rc in rcs) else ("hangs" if 124 in rcs else "refused")
    return {"name": "nccl-two-ranks-one-gpu", "rc": max(rcs), "verdict": verdict,
            "errors": list(dict.fromkeys(errors))[:8]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--negative", action="store_true", help="run the stress with fences removed (expect failure)")
    ap.add_argument("--nccl-two-ranks", action="store_true", help="try 2 NCCL ranks on one GPU")
    ap.add_argument("--suite", action="store_true", help="also run the rest of the test suite")
    ap.add_argument("--also", action="append", default=[], help="a further command to run (repeatable)")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per step")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json")
    ap.add_argument("--_nccl-child", nargs=2, type=int, help=argparse.SUPPRESS, dest="nccl_child")
    args = ap.parse_args(argv)
    if args.nccl_child:
        _nccl_two_ranks_child(*args.nccl_child)
        return 0

    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    report["card"] = card_info()
    steps = []
    py = sys.executable
    res = _run("gpu-tests", [py, "-m", "pytest", "-v", "-s", "-rA", "-p", "no:cacheprovider",
                             "tests/test_gpu.py"], args.timeout)
    res["summary"] = _pytest_summary(res)
    steps.append(res)
    if args.negative:
        for brk, sel in (("fence", "stress and cross_stream"), ("nccl_wait", "stress and in_step")):
            res = _run(f"negative-{brk}", [py, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                                           "tests/test_gpu.py", "-k", sel], args.timeout,
                       {"FLODL_GPU_BREAK": brk})
            res["summary"] = _pytest_summary(res)
            res["expected"] = "fail"
            res["caught"] = res["rc"] not in (0, 124)
            steps.append(res)
    if args.nccl_two_ranks:
        steps.append(nccl_two_ranks())
    if args.suite:
        res = _run("suite", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests",
                             "--ignore=tests/test_gpu.py"], args.timeout)
        res["summary"] = _pytest_summary(res)
        steps.append(res)
    for cmd in args.also:
        steps.append(_run(f"also: {cmd}", shlex.split(cmd), args.timeout))
    report["steps"] = steps

    print("\n===== summary")
    print(f"card: {report['card'].get('name')} | torch {report['card']['torch']} | CUDA "
          f"{report['card']['cuda']} | NCCL {report['card']['nccl']}")
    for s in steps:
        what = s.get("summary") or s.get("verdict") or f"rc={s['rc']}"
        note = ""
        if "expected" in s:
            note = "  (expected to fail: " + ("CAUGHT" if s["caught"] else "NOT caught") + ")"
        print(f"{s['name'][:60]:60s} {what}{note}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1)
    ok = all(s["rc"] == 0 for s in steps if "expected" not in s and not s["name"].startswith("nccl-two"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
