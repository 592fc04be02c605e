"""The repository's Python sources read only names they bind.

Much of the code runs only on a GPU -- the ``gpu``-marked tests, the CuPy launch paths, the benchmarks -- and CI's
machine has none, so a misspelt or stray name there would raise NameError only where CI never looks.  The symbol
tables of the standard library see every such read without running the code: a name that a function or class body
reads as a global must be bound at its module's top level (assigned, defined or imported) or be a builtin.
"""

import builtins
import symtable

import pytest

from repo import ROOT, tracked

MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__package__", "__path__",
                "__builtins__"}


def unbound_globals(source, name="<source>"):
    """``[(scope, line, name)]`` of the names that scopes of ``source`` read as globals and its top level never
    binds."""
    top = symtable.symtable(source, name, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    known = bound | set(dir(builtins)) | MODULE_NAMES
    found = [("<module>", 0, s.get_name()) for s in top.get_symbols()
             if s.is_referenced() and s.get_name() not in known]

    def walk(table):
        for child in table.get_children():
            found.extend((child.get_name(), child.get_lineno(), s.get_name()) for s in child.get_symbols()
                         if s.is_referenced() and s.is_global() and s.get_name() not in known)
            walk(child)

    walk(top)
    return found


def test_the_check_finds_a_stray_name():
    """A comprehension's variable read after it (the NameError a GPU-only test once had) and a misspelt global;
    locals, closures, builtins and module bindings pass."""
    source = ("import os\nLIMIT = 3\n\ndef f(xs):\n    ys = [x for x in xs]\n    return x, ys\n\n"
              "def g():\n    def h():\n        return n + LIMIT + len(os.sep)\n    n = 1\n    return h, LIMTI\n")
    assert unbound_globals(source) == [("f", 4, "x"), ("g", 8, "LIMTI")]


@pytest.mark.parametrize("path", tracked("*.py"))
def test_every_global_a_source_reads_is_bound(path):
    assert unbound_globals((ROOT / path).read_text(), path) == []
