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
