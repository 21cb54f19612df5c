"""The examples under the launchers users already have: Open MPI's mpirun and torchrun.

mpirun starts the Horovod example (DistributedOptimizer), torchrun the DDP script switched to local
SGD; both launches cost a few seconds of process start-up each, so there are just these two (and
a short script launched 4 times that checks the ranks exit cleanly right after their last collective).

Each launch starts 2 real processes that find each other from the launcher's environment alone
(flodl_opt.init / torch.distributed.init_process_group), train on different data shards, and print
their world size and a checksum of their final parameters. Equal checksums on both ranks mean the
ranks really communicated (their shards differ, so unsynced ranks would end apart).
"""
import os
import re
import shutil
import sys

import pytest

from dist_harness import launcher_env, run_launcher

TIMEOUT_S = 240
NUM = r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
LINE = re.compile(rf"rank (\d+) of (\d+)(?: \((\w+)\))?: .*?param_checksum=({NUM})")

pytestmark = pytest.mark.launcher


def _ranks(out):
    found = {int(m.group(1)): (int(m.group(2)), m.group(3), float(m.group(4))) for m in LINE.finditer(out)}
    assert sorted(found) == [0, 1], f"expected a final line from ranks 0 and 1:\n{out[-4000:]}"
    return found


MNIST = ["examples/horovod_mnist.py", "--epochs", "1", "--train-samples", "512", "--test-samples", "256"]


def _mpirun(*argv: str) -> list:
    """2 local ranks of ``python argv...`` under Open MPI, with the test's port, threads and path."""
    # one node needs no remote shell; without ssh/rsh Open MPI's default launcher refuses to start
    local = [] if shutil.which("ssh") or shutil.which("rsh") else ["--mca", "plm", "isolated"]
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", *local,
            "-x", "MASTER_PORT", "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH", sys.executable, *argv]


def test_mpirun_runs_the_horovod_example():
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found: install Open MPI (Debian: apt-get install openmpi-bin)")
    ranks = _ranks(run_launcher(_mpirun(*MNIST), launcher_env(), timeout=TIMEOUT_S))
    assert {w for w, _, _ in ranks.values()} == {2}
    assert {launcher for _, launcher, _ in ranks.values()} == {"openmpi"}
    assert ranks[0][2] == ranks[1][2]  # DistributedOptimizer kept both ranks identical


def test_torchrun_runs_the_ddp_script_with_local_sgd():
    env = launcher_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "examples/ddp_train.py", "--epochs", "1", "--samples", "512", "--sync-every", "4", "--warmup", "2"]
    out = run_launcher(cmd, env, timeout=TIMEOUT_S)
    ranks = _ranks(out)
    assert {w for w, _, _ in ranks.values()} == {2}
    assert ranks[0][2] == ranks[1][2]
    # the ranks drifted apart between syncs: DDP's gradient all-reduce really was off
    divergences = [float(d) for d in re.findall(rf"last_sync_divergence=({NUM})", out)]
    assert len(divergences) == 2 and all(d > 0 for d in divergences), out[-2000:]


def test_multi_node_slurm_without_ntasks_per_node_does_not_assume_one_node(monkeypatch):
    """srun -N 2 -n 4 sets no SLURM_NTASKS_PER_NODE: loopback would strand the second node."""
    from flodl_opt import launch
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NNODES": "2",
           "SLURM_JOB_ID": "77"}
    for v in ("MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NUM_NODES"):
        monkeypatch.setenv(v, "")  # recorded, so what _rendezvous_env sets is undone afterwards
        monkeypatch.delenv(v)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(launch, "_master_addr_over_mpi", lambda: None)
    info = launch.discover()
    assert (info.launcher, info.size) == ("slurm", 4)
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set"):
        launch._rendezvous_env(info)
    monkeypatch.setenv("SLURM_NNODES", "1")  # one node: loopback and a port from the job id
    launch._rendezvous_env(info)
    lo, hi = launch._port_window()
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and lo <= int(os.environ["MASTER_PORT"]) < hi


EXIT_RACE = '''
import torch, torch.distributed as dist
import flodl_opt as flo
flo.init()
held = dist.group.WORLD  # as an optimizer does: the group outlives destroy_process_group
for _ in range(20):
    dist.all_reduce(torch.ones(1000))  # a temporary: Gloo's worker holds its last reference
flo.shutdown()
print("exits cleanly", flush=True)
'''


def test_ranks_exit_cleanly_right_after_their_last_collective(tmp_path):
    """Gloo's worker threads must not be left needing the GIL when the interpreter finalizes:
    without flodl_opt's exit grace this script aborted (signal 6) in 8 of 10 mpirun launches."""
    script = tmp_path / "exit_race.py"
    script.write_text(EXIT_RACE)
    if shutil.which("mpirun"):
        cmd = _mpirun(str(script))
    else:  # torchrun: the abort came in 2 of 5 launches
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(script)]
    for _ in range(4):
        out = run_launcher(cmd, launcher_env(), timeout=120)
        assert out.count("exits cleanly") == 2, out[-2000:]
