"""Runs every lesson (``examples/NN_*.py``) to the end.

Each lesson asserts the numbers it prints (each assertion with its tolerance
and reason) and exports the ones the docs quote (``HEADLINE``); here it must
run to the end. The lessons run in this process (one JAX start-up, the 8 fake
CPU devices of ``conftest.py``), once: ``docs_numbers_test.py`` checks the
docs against the same runs, by name (under ``--dist loadfile``, ``conftest.py``
hands the files that read these runs to one worker).
"""

from __future__ import annotations

import _headlines
import pytest

pytestmark = pytest.mark.slow  # processes, or minutes of compiling: `make test` only


def test_there_are_lessons():
    assert [p.name[:2] for p in _headlines.LESSONS] == [
        f"{i:02d}" for i in range(1, len(_headlines.LESSONS) + 1)
    ]
    assert len(_headlines.LESSONS) >= 9


@pytest.mark.parametrize("path", _headlines.LESSONS, ids=lambda p: p.stem)
def test_lesson(path):
    # The lesson asserts its own numbers (each with its tolerance); here it must
    # run to the end, print them and export the ones the docs quote.
    _headlines.skip_unless_runnable([path.name[:2]])
    run = _headlines.lesson(path.name[:2])
    assert run.output.strip() and run.exports
