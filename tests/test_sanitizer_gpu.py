"""compute-sanitizer memcheck over every kernel variant with hostile pool indices (``pytest -m gpu``)."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not installed")
def test_hostile_indices_are_memcheck_clean():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
               CUPY_COMBA_GRAPH_LAUNCH="0")
    run = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", sys.executable,
                          os.path.join(HERE, "hostile_indices.py")], capture_output=True, text=True, env=env,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in run.stdout and "launches with hostile indices" in run.stdout
