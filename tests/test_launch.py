"""Launch discovery from each launcher's environment variables (real launches: test_launchers.py)."""
import os
import subprocess
import sys

import pytest

import flodl_opt as flo
from flodl_opt import launch

CASES = {
    "torchrun": ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (3, 8, 1, 2)),
    "openmpi": ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6",
                 "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, (5, 6, 2, 3)),
    "mpich": ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}, (1, 4, 1, 4)),
    "slurm": ({"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3",
               "SLURM_NTASKS_PER_NODE": "4(x4)"}, (7, 16, 3, 4)),
    "python": ({}, (0, 1, 0, 1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_discover_reads_each_launcher(name):
    env, want = CASES[name]
    info = launch.discover(env)
    assert info.launcher == name
    assert (info.rank, info.size, info.local_rank, info.local_size) == want


def test_torchrun_wins_inside_an_mpi_allocation():
    env = dict(CASES["openmpi"][0], **CASES["torchrun"][0])
    assert launch.discover(env).launcher == "torchrun"


def test_bad_launcher_values_say_which_variable():
    with pytest.raises(RuntimeError, match="PMI_SIZE='four'"):
        launch.discover({"PMI_RANK": "0", "PMI_SIZE": "four"})
    with pytest.raises(RuntimeError, match="outside world size"):
        launch.discover({"RANK": "4", "WORLD_SIZE": "4"})


def test_multi_node_mpi_without_master_addr_says_what_to_set(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "")  # recorded, so the test leaves the variable as it found it
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # pretend mpi4py is not installed
    info = launch.LaunchInfo("openmpi", 0, 8, 0, 4)
    with pytest.raises(RuntimeError, match="export MASTER_ADDR|MASTER_ADDR is not set"):
        launch._rendezvous_env(info)


def test_single_node_mpi_defaults_to_loopback_and_a_job_port(monkeypatch):
    for v in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(v, "")  # recorded, so what _rendezvous_env sets is undone afterwards
        monkeypatch.delenv(v)
    monkeypatch.setenv("OMPI_MCA_ess_base_jobid", "1234")
    launch._rendezvous_env(launch.LaunchInfo("openmpi", 0, 2, 0, 2))
    port = int(os.environ["MASTER_PORT"])
    lo, hi = launch._port_window()
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and lo <= port < hi
    # every rank of the same job derives the same port
    monkeypatch.delenv("MASTER_PORT")
    launch._rendezvous_env(launch.LaunchInfo("openmpi", 1, 2, 1, 2))
    assert int(os.environ["MASTER_PORT"]) == port


def test_job_port_stays_outside_the_ephemeral_range(tmp_path, monkeypatch):
    # outgoing connections take ports of the ephemeral range: a derived MASTER_PORT there can
    # already be held (EADDRINUSE on rank 0)
    def window(text):
        f = tmp_path / "range"
        f.write_text(text)
        return launch._port_window(str(f))
    assert window("32768\t60999\n") == (10000, 32768)       # Linux's default range
    assert window("20000 60999") == (10000, 20000)
    assert window("1024 50000") == (50001, 65536)              # nothing below: above it
    assert window("1024 65000") == (10000, 32768)              # no room: the default window
    assert launch._port_window(str(tmp_path / "missing")) == (10000, 32768)
    first, last = 32768, 60999
    if os.path.exists(launch._EPHEMERAL_RANGE):
        first, last = (int(v) for v in open(launch._EPHEMERAL_RANGE).read().split())
    for v in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(v, "")  # recorded, so what _rendezvous_env sets is undone afterwards
    for job in range(200):
        for v in ("MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(v, raising=False)
        monkeypatch.setenv("OMPI_MCA_ess_base_jobid", str(job))
        launch._rendezvous_env(launch.LaunchInfo("openmpi", 0, 2, 0, 2))
        port = int(os.environ["MASTER_PORT"])
        assert not first <= port <= last and 1024 <= port < 65536, (job, port)


def test_world_of_one_has_no_process_group_and_is_idempotent():
    import torch.distributed as dist
    flo.init()
    flo.init()
    assert (flo.rank(), flo.size(), flo.local_rank(), flo.local_size()) == (0, 1, 0, 1)
    import torch
    want = ("nccl", "cuda:0") if torch.cuda.is_available() else ("gloo", "cpu")
    assert (flo.backend(), str(flo.device())) == want
    assert not dist.is_initialized()


def test_rank_helpers_before_init_fail_clearly():
    with pytest.raises(RuntimeError, match=r"call flodl_opt.init\(\) first"):
        flo.rank()


def test_cpu_threads_are_shared_among_local_ranks():
    code = ("import torch, flodl_opt as f, psutil, os; f.init(); "
            "cores = min(psutil.cpu_count(logical=False) or 1, len(os.sched_getaffinity(0))); "
            "print(torch.get_num_threads(), max(1, cores // 2))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks are the ones whose threads are shared
    # a world of one that says it has 2 local ranks: discover() reads LOCAL_WORLD_SIZE, size stays 1
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got, want = out.stdout.split()
    assert got == want
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split()[0] == "1"
