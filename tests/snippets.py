"""The code blocks of a docs page, for the tests that run them: ```python blocks run anywhere, ```python gpu
blocks on the GPU (in order, in one namespace)."""

import re

from repo import ROOT

DOCS = ROOT / "docs"


def blocks(page, tag=""):
    text = (DOCS / page).read_text()
    info = "python" + (" " + tag if tag else "")
    return [m.group(1) for m in re.finditer(r"^```" + re.escape(info) + r"\n(.*?)^```$", text, re.M | re.S)]


def run(page, tag=""):
    """Executes the page's blocks of ``tag``; returns how many ran."""
    found = blocks(page, tag)
    namespace = {}
    for i, code in enumerate(found):
        exec(compile(code, f"{page}, {'python ' + tag if tag else 'python'} block {i + 1}", "exec"), namespace)
    return len(found)
