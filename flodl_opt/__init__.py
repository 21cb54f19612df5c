"""flodl_opt: communication-efficient data-parallel training for PyTorch.

Wrap the optimizer of an existing script in one line; ranks train locally and every K steps agree
on a work-weighted consensus of their weights through one fused collective, optionally followed by
an outer optimizer step (DiLoCo, SlowMo, EASGD).

    import flodl_opt as flo
    flo.init()
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model, sync_every=16)
"""
from .hooks.adaptive import AdaptiveSync
from .sync.stats import SyncStats
from .dcp import DCPState
from .checkpoint import (CheckpointSyncError, CheckpointWriteError, UnsafeCheckpointWarning, load_checkpoint,
                         save_checkpoint, wait_checkpoint)
from .errors import (AveragedElsewhereWarning, CollectiveMismatchError, ConfigError, ForeignMomentsWarning,
                     ForeignRankStateWarning, InexactResumeWarning, NonFiniteError, NonFiniteWarning, SyncError,
                     UnsyncedExitWarning)
from .horovod import (Adasum, Average, Compression, DistributedOptimizer, Max, Min, Product, Sum, allgather,
                      allgather_async, allgather_object, allreduce, allreduce_, allreduce_async,
                      allreduce_async_, barrier, broadcast, broadcast_, broadcast_async, broadcast_async_,
                      broadcast_object, broadcast_optimizer_state, broadcast_parameters, ccl_built,
                      cuda_built, ddl_built, gloo_built, gloo_enabled, grouped_allgather,
                      grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                      grouped_allreduce_async, grouped_allreduce_async_, join, mpi_built, mpi_enabled,
                      mpi_threads_supported, nccl_built, poll, rocm_built, synchronize)
from .launch import (backend, device, init, is_initialized, launch_info, local_rank, local_size, rank,
                     shutdown, size)
from .optimizer import LocalSGDOptimizer
from .hooks.outer import DiLoCo, EASGD, OuterAvg, OuterOptimizer, SlowMo, TorchOuter

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "device",
    "backend", "launch_info", "LocalSGDOptimizer", "AdaptiveSync", "SyncStats", "OuterOptimizer", "OuterAvg",
    "DiLoCo", "SlowMo", "EASGD", "TorchOuter", "SyncError", "ConfigError",
    "NonFiniteError", "NonFiniteWarning", "CheckpointSyncError", "CheckpointWriteError",
    "UnsafeCheckpointWarning", "save_checkpoint", "load_checkpoint", "wait_checkpoint",
    "DistributedOptimizer", "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression", "allreduce",
    "allreduce_", "allgather", "allgather_object", "broadcast", "broadcast_", "broadcast_object",
    "broadcast_parameters", "broadcast_optimizer_state", "allreduce_async", "allreduce_async_",
    "allgather_async", "broadcast_async", "broadcast_async_", "poll", "synchronize", "join", "barrier",
    "AveragedElsewhereWarning", "DCPState", "InexactResumeWarning", "ForeignRankStateWarning",
    "ForeignMomentsWarning", "UnsyncedExitWarning",
    "CollectiveMismatchError", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_allgather", "grouped_allgather_async", "nccl_built", "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "cuda_built", "rocm_built", "ccl_built", "ddl_built",
]
