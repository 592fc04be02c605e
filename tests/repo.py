"""The repository as the tests read it: its tracked files and the benchmark renderer (a script, not a module of the
package)."""

import importlib.util
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def tracked(*patterns):
    """Paths (relative to the root) of the files git tracks that match the ``git ls-files`` ``patterns``; outside a
    git checkout, every such file but those of a virtual environment."""
    try:
        listed = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True)
    except OSError:  # no git
        listed = None
    if listed is None or listed.returncode:
        return sorted({str(p.relative_to(ROOT)) for pattern in patterns for p in ROOT.rglob(pattern)
                       if ".venv" not in p.parts})
    return sorted(listed.stdout.split())


def renderer():
    """benchmarks/render_benchmarks.py, loaded as a module."""
    spec = importlib.util.spec_from_file_location("render_benchmarks", ROOT / "benchmarks" / "render_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
