"""The setup of the scripts test_sanitizer_gpu.py runs under compute-sanitizer."""

import cupy

from cupy_comba import _launcher


def exact_workspaces():
    """Every long-prompt call from here on gets a workspace of its own, allocated at its size from an emptied
    pool.  In the stream's shared buffer, grown to the largest call and rounded to 1 MiB, memcheck would not see a
    kernel run past its own call's records."""
    def fresh(device, stream):
        cupy.get_default_memory_pool().free_all_blocks()
        return _launcher.Workspace()

    _launcher.WORKSPACE_STEP = 1
    _launcher.workspace = fresh
