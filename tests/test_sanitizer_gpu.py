"""compute-sanitizer over every kernel variant (``pytest -m gpu``): memcheck with hostile pool indices, racecheck
and memcheck over the prefill kernels' chunk loop, and racecheck over the other families that stage tokens through
shared memory."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))


needs_sanitizer = pytest.mark.skipif(shutil.which("compute-sanitizer") is None,
                                     reason="compute-sanitizer is not installed")


def _sanitize(tool, script):
    """stdout of ``script`` (in tests/) run under ``compute-sanitizer --tool tool``, which must exit cleanly."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
               CUPY_COMBA_GRAPH_LAUNCH="0")
    run = subprocess.run(["compute-sanitizer", "--tool", tool, "--error-exitcode", "3", sys.executable,
                          os.path.join(HERE, script)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run.stdout


@needs_sanitizer
def test_hostile_indices_are_memcheck_clean():
    out = _sanitize("memcheck", "hostile_indices.py")
    assert "ERROR SUMMARY: 0 errors" in out and "launches with hostile indices" in out


@needs_sanitizer
@pytest.mark.parametrize("tool", ["racecheck", "memcheck"])
def test_prefill_chunks_are_sanitizer_clean(tool):
    out = _sanitize(tool, "prefill_chunks.py")
    clean = "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" if tool == "racecheck" else \
        "ERROR SUMMARY: 0 errors"
    assert clean in out and "prefill launches over several chunks" in out


@needs_sanitizer
def test_shared_memory_families_are_racecheck_clean():
    out = _sanitize("racecheck", "forward_variants.py")
    assert "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" in out
    assert "launches over the shared-memory families" in out
