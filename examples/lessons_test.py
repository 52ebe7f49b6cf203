"""Runs every lesson (``examples/NN_*.py``) and checks ``docs/math.md`` against them.

Each lesson asserts the numbers it prints (each assertion with its tolerance
and reason); here it must run to the end. The lessons run in this process
(one JAX start-up, the 8 fake CPU devices of ``conftest.py``), and their
output is kept for the last test: every number quoted in ``docs/math.md``
must be printed by a lesson.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib
import re
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent
LESSONS = sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))
MATH_MD = EXAMPLES.parent / "docs" / "math.md"

if str(EXAMPLES) not in sys.path:  # the lessons import _common
    sys.path.insert(0, str(EXAMPLES))


_OUTPUT: dict[str, str] = {}


def run_lesson(path: pathlib.Path) -> str:
    """Imports the lesson, runs ``main()`` and returns what it printed (cached)."""
    if path.name not in _OUTPUT:
        spec = importlib.util.spec_from_file_location(f"lesson_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = module.main()
        assert status == 0, f"{path.name} returned {status}"
        _OUTPUT[path.name] = out.getvalue()
    return _OUTPUT[path.name]


def test_there_are_lessons():
    assert [p.name[:2] for p in LESSONS] == [f"{i:02d}" for i in range(1, len(LESSONS) + 1)]
    assert len(LESSONS) >= 8


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson(path):
    # The lesson asserts its own numbers (each with its tolerance); here it must
    # run to the end and print them.
    assert run_lesson(path).strip()


# A number: 1/20, 0.42, 27.5 (of 27.5x), 50.00 (of 50.00%), 65536, 1e-6 ...
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)*(?:e-?\d+)?(?:/\d+)?")


def numbers(text: str) -> set[str]:
    return {n.rstrip(".") for n in _NUMBER.findall(text)}


def doc_numbers(text: str) -> set[str]:
    """The numbers quoted in ``text``, outside links, section numbers and file names."""
    text = re.sub(r"\[\d+\]\([^)]*\)", "", text)  # [01](../examples/...), [3](#3-...)
    text = re.sub(r"\]\([^)]*\)", "]", text)  # other link targets
    text = re.sub(r"\b\d\d_\w+\.py", "", text)  # file names
    text = re.sub(r"^#+\s*\d+\.?", "", text, flags=re.M)  # section numbers
    return numbers(text)


# Structural integers that are not measurements: list items, k=1, "R devices".
_STRUCTURAL = {str(i) for i in range(0, 10)}


def test_every_number_in_the_math_doc_is_printed_by_a_lesson():
    if not MATH_MD.exists():
        pytest.skip("docs/math.md not written yet")
    printed = "\n".join(run_lesson(p) for p in LESSONS)
    printed_numbers = numbers(printed)
    missing = sorted(doc_numbers(MATH_MD.read_text()) - printed_numbers - _STRUCTURAL)
    assert not missing, f"docs/math.md quotes numbers that no lesson prints: {missing}"
