"""The runnable examples in the public docstrings (they use the NumPy path, so they run on any machine)."""

import doctest

import pytest

import cupy_comba
import cupy_comba.bench
import cupy_comba.decode
import cupy_comba.families
import cupy_comba.forward
import cupy_comba.inputs
import cupy_comba.reference
import cupy_comba.tiling

MODULES = [cupy_comba.decode, cupy_comba.forward, cupy_comba.reference, cupy_comba.inputs, cupy_comba.bench,
           cupy_comba.families, cupy_comba.tiling]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0


@pytest.mark.parametrize("page", ["api.md", "serving.md"])
def test_page_examples(page):
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "docs" / page
    result = doctest.testfile(str(path), module_relative=False, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_integrations_page_cpu_blocks():
    import snippets

    assert snippets.run("integrations.md") >= 1



def test_serving_tables_are_the_results_rendering():
    """docs/serving.md's decode, forward and verify tables are what benchmarks/render_benchmarks.py makes of
    benchmarks/results/h200-serving.json, so a re-run of benchmarks/serving.py reaches the page by one command."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("render_benchmarks", root / "benchmarks" / "render_benchmarks.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    report = json.loads((root / "benchmarks" / "results" / "h200-serving.json").read_text())
    assert render.block_of(report) == "serving"
    page = (root / "docs" / "serving.md").read_text()
    for name, table in render.serving_tables(report).items():
        begin, end = render.BLOCKS[name]
        assert table.count("\n") >= 5
        assert f"{begin}\n{table}\n\n(from `benchmarks/results/h200-serving.json`)\n{end}" in page, name


def test_section_references_name_sections_that_exist():
    """Every `<page>.md, "<Section>"` that a source, test or page cites names a heading of docs/<page>.md (the
    heading may go on past the name: "Segments" for "Segments: the parallel split")."""
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    try:
        listed = subprocess.run(["git", "ls-files", "*.py", "*.cu", "*.cuh", "*.md"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        listed = [str(p.relative_to(root)) for ext in ("py", "cu", "cuh", "md") for p in root.rglob(f"*.{ext}")
                  if ".venv" not in p.parts]
    headings = {}
    cited = []
    for name in listed:
        text = (root / name).read_text()
        cited += [(name, page, " ".join(section.split()))  # a name may break across lines
                  for page, section in re.findall(r'\b([a-z0-9_-]+)\.md,? \(?"([A-Z][^"]*)"', text)]
    assert len(cited) > 20
    for name, page, section in cited:
        if page not in headings:
            path = root / "docs" / f"{page}.md"
            assert path.exists(), f"{name} cites {page}.md"
            headings[page] = [line.lstrip("#").strip() for line in path.read_text().splitlines()
                              if line.startswith("#")]
        assert any(h.startswith(section) for h in headings[page]), f"{name} cites {page}.md, {section!r}"
