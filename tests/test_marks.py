"""The suite's marks are where pytest reads them.

A mark decorates a test (or its class, or a module's pytestmark). On any other function it marks
nothing, silently: a Slurm test's bench, e2e and timeout marks once sat on the helper below it,
so the test ran in the SQLite pass and again on PostgreSQL (69 s each) instead of once, in its
lane of bin/test, under the default timeout instead of its own.
"""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def marks_on_other_functions(source):
    """[(line, function, mark)] of the pytest marks decorating a function that is not a test."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("test"):
            for decorator in node.decorator_list:
                text = ast.unparse(decorator)
                if text.startswith(("pytest.mark.", "mark.")):
                    found.append((node.lineno, node.name, text))
    return found


@pytest.mark.nodb
def test_a_mark_on_a_helper_is_found():
    source = "import pytest\n\n@pytest.mark.bench\ndef helper():\n    pass\n\n@pytest.mark.e2e\ndef test_it():\n    pass\n"
    assert marks_on_other_functions(source) == [(4, "helper", "pytest.mark.bench")]


@pytest.mark.nodb
def test_every_mark_decorates_a_test():
    misplaced = [
        f"{path.name}:{line} {name}: @{mark}" for path in sorted(TESTS.glob("*.py")) for line, name, mark in marks_on_other_functions(path.read_text())
    ]
    assert not misplaced, "marks on functions that are not tests (they mark nothing): " + "; ".join(misplaced)
