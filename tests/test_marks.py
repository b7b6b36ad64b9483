"""The suite's marks are where pytest reads them.

A mark decorates a test, a test class or a test method (or a test module's pytestmark). On any
other function or class it marks nothing, silently: a Slurm test's bench, e2e and timeout marks
once sat on the helper below it, so the test ran in the SQLite pass and again on PostgreSQL (69 s
each) instead of once, in its lane of bin/test, under the default timeout instead of its own.
"""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _mark_spellings(tree):
    """(prefixes, names): how the module writes a mark. Prefixes: pytest's name and .mark (import
    pytest [as p]: "p.mark"), or mark's own name (from pytest import mark [as m]: "m"); names:
    the module's names bound to a mark (nodb = pytest.mark.nodb)."""
    prefixes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            prefixes |= {f"{alias.asname or alias.name}.mark" for alias in node.names if alias.name == "pytest"}
        elif isinstance(node, ast.ImportFrom) and node.module == "pytest":
            prefixes |= {alias.asname or alias.name for alias in node.names if alias.name == "mark"}
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _is_mark(node.value, prefixes, ()):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return prefixes, names


def _is_mark(expr, prefixes, names):
    text = ast.unparse(expr.func if isinstance(expr, ast.Call) else expr)
    return text in names or any(text == prefix or text.startswith(prefix + ".") for prefix in prefixes)


def misplaced_marks(source, test_module=True):
    """[(line, name, mark)] of the marks that mark nothing: on a function that is not a test (a
    module's test_* function, or a test_* method of a Test* class), on a class not named Test*,
    and, outside a test module, a pytestmark."""
    tree = ast.parse(source)
    prefixes, names = _mark_spellings(tree)
    collected = set()  # the definitions pytest collects
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            collected.add(node)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            collected.add(node)
            collected |= {item for item in node.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name.startswith("test")}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node not in collected:
            found += [(node.lineno, node.name, ast.unparse(d)) for d in node.decorator_list if _is_mark(d, prefixes, names)]
    if not test_module:
        found += [
            (node.lineno, "pytestmark", ast.unparse(node.value))
            for node in tree.body
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        ]
    return sorted(found)


HELPER = """
import pytest
from pytest import mark as m
import pytest as p

nodb = pytest.mark.nodb


@pytest.mark.bench
def helper():
    pass


@nodb
def another_helper():
    pass


@m.e2e
class Helpers:
    @p.mark.timeout(5)
    def test_not_collected(self):
        pass


class TestThings:
    @pytest.mark.e2e
    def test_collected(self):
        pass

    @pytest.mark.e2e
    def helper(self):
        pass


@pytest.mark.e2e
def test_collected():
    @nodb
    def test_nested():
        pass
"""


@pytest.mark.nodb
def test_each_way_of_writing_a_misplaced_mark_is_found():
    assert misplaced_marks(HELPER) == [
        (10, "helper", "pytest.mark.bench"),
        (15, "another_helper", "nodb"),
        (20, "Helpers", "m.e2e"),
        (22, "test_not_collected", "p.mark.timeout(5)"),
        (32, "helper", "pytest.mark.e2e"),
        (39, "test_nested", "nodb"),
    ]
    assert misplaced_marks("import pytest\npytestmark = pytest.mark.e2e\n", test_module=False) == [(2, "pytestmark", "pytest.mark.e2e")]
    assert misplaced_marks("import pytest\npytestmark = pytest.mark.e2e\n") == []


@pytest.mark.nodb
def test_every_mark_marks_a_test():
    misplaced = [
        f"{path.name}:{line} {name}: {mark}"
        for path in sorted(TESTS.glob("*.py"))
        for line, name, mark in misplaced_marks(path.read_text(), test_module=path.name.startswith("test_"))
    ]
    assert not misplaced, "marks that mark nothing: " + "; ".join(misplaced)
