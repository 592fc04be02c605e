"""The runnable examples in the public docstrings (they use the NumPy path, so they run on any machine), and the
pages held to what they cite: results files rendered, sections that exist."""

import doctest
import json
import re

import pytest

import cupy_comba
import cupy_comba.bench
import cupy_comba.decode
import cupy_comba.families
import cupy_comba.forward
import cupy_comba.inputs
import cupy_comba.reference
import cupy_comba.tiling
from repo import ROOT, renderer, tracked

MODULES = [cupy_comba.decode, cupy_comba.forward, cupy_comba.reference, cupy_comba.inputs, cupy_comba.bench,
           cupy_comba.families, cupy_comba.tiling]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0


@pytest.mark.parametrize("page", ["api.md", "serving.md"])
def test_page_examples(page):
    path = ROOT / "docs" / page
    result = doctest.testfile(str(path), module_relative=False, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_integrations_page_cpu_blocks():
    import snippets

    assert snippets.run("integrations.md") >= 1


def test_serving_tables_are_the_results_rendering():
    """docs/serving.md's decode, forward and verify tables are what benchmarks/render_benchmarks.py makes of
    benchmarks/results/h200-serving.json, so a re-run of benchmarks/serving.py reaches the page by one command."""
    render = renderer()
    report = json.loads((ROOT / "benchmarks" / "results" / "h200-serving.json").read_text())
    assert render.block_of(report) == "serving"
    page = (ROOT / "docs" / "serving.md").read_text()
    for name, table in render.tables(report).items():
        begin, end = render.BLOCKS[name]
        assert table.count("\n") >= 5
        assert f"{begin}\n{table}\n\n(from `benchmarks/results/h200-serving.json`)\n{end}" in page, name


def test_section_references_name_sections_that_exist():
    """Every `<page>.md, "<Section>"` that a source, test or page cites names a heading of docs/<page>.md (the
    heading may go on past the name: "Segments" for "Segments: the parallel split")."""
    headings = {}
    cited = []
    for name in tracked("*.py", "*.cu", "*.cuh", "*.md"):
        text = (ROOT / name).read_text()
        cited += [(name, page, " ".join(section.split()))  # a name may break across lines
                  for page, section in re.findall(r'\b([a-z0-9_-]+)\.md,? \(?"([A-Z][^"]*)"', text)]
    assert len(cited) > 20
    for name, page, section in cited:
        if page not in headings:
            path = ROOT / "docs" / f"{page}.md"
            assert path.exists(), f"{name} cites {page}.md"
            headings[page] = [line.lstrip("#").strip() for line in path.read_text().splitlines()
                              if line.startswith("#")]
        assert any(h.startswith(section) for h in headings[page]), f"{name} cites {page}.md, {section!r}"
