"""tools/bench_wan.py for real: ranks in network namespaces behind a tc-shaped link.

Runs the quickest mode (2 ranks, DDP and local SGD for a few dozen steps, one rate) where network
namespaces can be made (root, iproute2), and is skipped with the reason elsewhere. It checks what
every figure of the benchmark rests on: the link measured at the rate that was set (the tool refuses
otherwise), the ranks ending with identical weights, the bytes on the wire, and nothing left behind.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "bench_wan.py")


def _namespaces_unavailable():
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (ip, tc) is not installed"
    name = f"flwantest{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        return f"`ip netns add` is not permitted here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    return None


def _own_namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("flwan")}


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_unknown_method_lists_the_valid_ones():
    r = subprocess.run([sys.executable, TOOL, "--methods", "ddp,nope"], capture_output=True, text=True,
                       timeout=60, env=_env())
    assert r.returncode == 2
    assert "nope" in r.stderr and "localsgd-k16" in r.stderr and "diloco-h64" in r.stderr


def _run_wan(tmp_path, *args: str) -> dict:
    """The tool's JSON for a short run (skipped where namespaces cannot be made); it left nothing behind."""
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    before = _own_namespaces()
    out = tmp_path / "wan.json"
    cmd = [sys.executable, TOOL, *args, "--eval-every", "16", "--eval-batches", "2", "--link-seconds", "1",
           "--run-timeout", "120", "--json", str(out), "--no-plot"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _own_namespaces() <= before  # everything it made is gone
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_shaped_link_and_identical_ranks(tmp_path):
    # One method and no anchor: no target, so it runs exactly --steps (the quickest mode).
    res = _run_wan(tmp_path, "--rates", "100mbit", "--methods", "localsgd-k16", "--steps", "32")
    assert list(res) == ["100mbit"] and list(res["100mbit"]) == ["localsgd-k16"]
    row = res["100mbit"]["localsgd-k16"]
    link = row["link"]
    assert link["set_mbit"] == 100.0 and len(link["probes_mbit"]) == 2
    for mbit in link["probes_mbit"]:  # both directions, each within 20% of the set rate
        assert 80.0 <= mbit <= 120.0, link
    hashes = row["param_sha256"]
    assert len(hashes) == 2 and hashes[0] == hashes[1], hashes
    for key in ("time_to_target_s", "final_loss", "loss_at_ddp_time", "bytes_per_rank", "wall_s"):
        assert key in row
    assert row["time_to_target_s"] is None and row["loss_at_ddp_time"] is None  # no anchor, no target
    assert row["steps"] == 32 and [p["step"] for p in row["curve"]] == [0, 16, 32]
    # Two syncs (K=16) of the 1.8 MB fp32 weights, plus the tiny work totals; the Gloo ring of two
    # ranks sends each rank's whole buffer once per sync, so at least that crossed each veth.
    grad_bytes = row["params"] * 4
    assert 2 * grad_bytes <= row["sync_bytes_per_rank"] < 2 * grad_bytes + 4096
    assert 2 * grad_bytes * 0.95 <= row["bytes_per_rank"] < 2 * grad_bytes * 1.5


@pytest.mark.timeout(300)
def test_streaming_row_stopped_at_the_target_ends_identical(tmp_path):
    """A run that stops at its target stops between fragment syncs: the ranks must still end equal."""
    # A target every evaluation meets: the run stops at the first one at or past --steps.
    res = _run_wan(tmp_path, "--rates", "1gbit", "--methods", "localsgd-k16-stream", "--steps", "24",
                   "--target-loss", "100")
    row = res["1gbit"]["localsgd-k16-stream"]
    assert row["stop"] == "target" and row["steps"] == 32, (row["stop"], row["steps"])
    hashes = row["param_sha256"]
    assert len(hashes) == 2 and hashes[0] == hashes[1], hashes


def _bench():
    """tools/bench_wan.py as a module (its driver code, no runs)."""
    from dist_harness import load_script
    return load_script("bench_wan", TOOL)


def test_recommended_row_is_the_library_recipe():
    from flodl_opt.recipes import SLOW_LINK
    bench = _bench()
    assert bench.METHODS["recommended"] == ("local", dict(SLOW_LINK))
    # Today's choice; the int8 row is the same setting with the compressed wire.
    assert dict(SLOW_LINK) == {"sync_every": 32, "outer": "diloco", "fragments": 4, "overlap_steps": 2,
                               "warmup_steps": 8, "wire": "int8"}
    assert bench.METHODS["diloco-h64-f4-o2-int8"] == ("local", {**bench.STREAM_DILOCO, "wire": "int8"})


def test_readme_states_the_recommended_setting():
    """The README tells a user on a slow link exactly the setting the benchmark races as `recommended`."""
    from flodl_opt.recipes import SLOW_LINK, as_call
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    line = as_call(SLOW_LINK)
    assert line.startswith('sync_every=') and 'outer="diloco"' in line
    assert line in readme, f"README.md does not state the recommended setting `{line}`"


def _row(kind, t, steps=None):
    return {"kind": kind, "time_to_target_s": t, "steps_to_target": steps}


def test_race_names_the_fastest_peer_and_the_ratios():
    bench = _bench()
    rows = {"ddp": _row("ddp", 80.0, 480), "ddp-powersgd8": _row("ddp", 20.0, 544),
            "postlocal-k16": _row("postlocal", None), "accel-localsgd-k16": _row("accel", 25.0, 704),
            "floor": _row("floor", 8.0, 480), "recommended": _row("local", 10.0, 704),
            "distopt": _row("distopt", 5.0, 480),  # a flodl row: never the best peer, however fast
            "diloco-h64-f4-o2-int8": {"kind": "local", "refused": "not yet"}}
    rc = bench.race(rows)
    assert rc["best_peer"] == "ddp-powersgd8" and rc["best_peer_s"] == 20.0 and rc["floor_s"] == 8.0
    rec = rc["rows"]["recommended"]
    assert rec["vs_ddp"] == 8.0 and rec["vs_best_peer"] == 2.0 and rec["x_floor"] == 1.25
    assert abs(rec["steps_vs_ddp"] - 704 / 480) < 1e-12
    assert rc["rows"]["postlocal-k16"]["vs_best_peer"] is None   # never reached the target
    table = bench.fmt_table("100mbit", {k: dict(v, steps=1, wall_s=1.0, loss_at_ddp_time=2.0, final_loss=2.0,
                                                bytes_per_rank=0) for k, v in rows.items()})
    assert table.startswith("best peer: ddp-powersgd8 (20.0 s); floor 8.0 s")
    assert "| diloco-h64-f4-o2-int8 | refused: not yet |" in table
    assert "| recommended | 1 | 704 (1.47x) | 1.0 | 10.0 | 8.00x | 2.00x | 1.25x |" in table


def test_bad_row_spec_says_what_to_write():
    r = subprocess.run([sys.executable, TOOL, "--row", "x={nope"], capture_output=True, text=True,
                       timeout=60, env=_env())
    assert r.returncode == 2 and "bench_wan: --row" in r.stderr and "is not JSON" in r.stderr


PEERS = ["ddp", "ddp-powersgd2", "ddp-fp16", "postlocal-k16", "accel-localsgd-k16", "floor", "recommended",
         "diloco-h64-f4-o2-int8"]


@pytest.mark.timeout(420)
def test_peer_rows_run_on_a_shaped_link(tmp_path):
    """Every peer row trains to the end over the shaped link with identical ranks; the bytes are each
    method's own; the floor runs DDP's steps to target with no traffic; a refused row is reported."""
    # 40 steps: well past post-local SGD's 16-step warm-up, so that its averager runs too
    res = _run_wan(tmp_path, "--rates", "100mbit", "--methods", ",".join(PEERS), "--steps", "40",
                   "--row", 'bad={"kind": "local", "sync_every": 0}')
    rows = res["100mbit"]
    assert list(rows) == PEERS + ["bad"]
    assert "sync_every" in rows["bad"]["refused"]  # a row the library refuses is reported, not a failure
    ddp = rows["ddp"]
    grad = ddp["params"] * 4
    assert ddp["sync_bytes_per_rank"] == 40 * grad
    for name in ("ddp", "ddp-powersgd2", "ddp-fp16", "postlocal-k16", "accel-localsgd-k16", "recommended",
                 "diloco-h64-f4-o2-int8"):
        row = rows[name]
        assert row["param_sha256"][0] == row["param_sha256"][1], name
        assert row["steps"] >= 40 and row["bytes_per_rank"] >= row["sync_bytes_per_rank"] * 0.95, name
    steps = lambda n: rows[n]["steps"]
    assert rows["ddp-fp16"]["sync_bytes_per_rank"] == steps("ddp-fp16") * grad // 2
    # PowerSGD: full gradients for its first 10 steps, then far fewer bytes per step
    psgd = rows["ddp-powersgd2"]
    assert 10 * grad < psgd["sync_bytes_per_rank"] < 10 * grad + (steps("ddp-powersgd2") - 10) * grad / 4
    # post-local SGD: DDP's all-reduce for 16 steps, then an average every 16 (the first right after)
    post = rows["postlocal-k16"]
    averages = len(range(17, steps("postlocal-k16") + 1, 16))
    assert steps("postlocal-k16") > 16 and averages >= 2
    assert post["sync_bytes_per_rank"] == (16 + averages) * grad
    accel = rows["accel-localsgd-k16"]
    assert accel["sync_bytes_per_rank"] == steps("accel-localsgd-k16") // 16 * grad
    floor = rows["floor"]
    assert floor["steps"] == ddp["steps_to_target"] and floor["sync_bytes_per_rank"] == 0
    assert floor["bytes_per_rank"] < 64 * 1024  # the evaluations' metric all-reduces are excluded too
    assert floor["time_to_target_s"] == floor["wall_s"]
    best = rows["recommended"]["race"]["best_peer"]
    assert best in ("ddp", "ddp-powersgd2", "ddp-fp16", "postlocal-k16", "accel-localsgd-k16")
    assert rows["recommended"]["race"]["vs_best_peer"] == pytest.approx(
        rows[best]["time_to_target_s"] / rows["recommended"]["time_to_target_s"])
