import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

# The suite runs as a world of one in the pytest process: launcher variables from the
# environment (a CI runner inside Slurm, say) must not leak into it.
for _v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
           "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
    os.environ.pop(_v, None)


@pytest.fixture(autouse=True)
def _fresh_world():
    """Each in-process test starts uninitialized and leaves nothing behind."""
    import flodl_opt as flo
    flo.shutdown()
    yield
    flo.shutdown()


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker: keywords also hold path parts
            item.add_marker(skip)
