import os

import numpy
import pytest

# JAX (used only by the interop test) must not grab most of the GPU memory at import.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from cupy_comba import gpu_available

HAS_GPU = gpu_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    return numpy.random.default_rng(1234)
