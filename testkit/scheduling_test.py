"""conftest.py's scheduler: under ``pytest -n 2 --dist loadfile`` (``make test``) the files
that read the lessons' runs are one unit of work, every other file one of its own."""

from __future__ import annotations

import pytest


@pytest.fixture
def conftest(pytestconfig):
    """The repository's conftest.py as pytest loaded it (another directory's conftest.py may
    hold the module name ``conftest``)."""
    return pytestconfig.pluginmanager.get_plugin(str(pytestconfig.rootpath / "conftest.py"))


@pytest.fixture
def loadfile_on_two_workers(pytestconfig, monkeypatch):
    """The test session's config as ``-n 2 --dist loadfile`` sets it."""
    for name, value in (("dist", "loadfile"), ("numprocesses", 2), ("tx", ["2*popen"])):
        monkeypatch.setattr(pytestconfig.option, name, value)
    return pytestconfig


def test_the_files_reading_the_lessons_runs_share_a_worker(conftest, loadfile_on_two_workers):
    scheduler = conftest.pytest_xdist_make_scheduler(config=loadfile_on_two_workers, log=None)
    # pytest-xdist (3.8, pinned) asks a scheduler's _split_scope for each test's unit of work
    unit = scheduler._split_scope
    shared = {unit(f"{test_file}::test_x[01]") for test_file in conftest.SHARED_RUNS}
    assert shared == {"examples/_headlines.py"}  # one unit: each run computed by one worker
    # every other file stays a unit of its own (a module's shared fixture computed once)
    assert unit("parity_tests/parity_test.py::test_every_run_completed") == (
        "parity_tests/parity_test.py"
    )
    assert unit("examples/flax_lm/data_parallel_test.py::test_x") == (
        "examples/flax_lm/data_parallel_test.py"
    )


def test_the_shared_files_exist_and_other_modes_keep_xdist_s_scheduler(
    conftest, loadfile_on_two_workers
):
    # a renamed file would quietly leave the group and its runs would be computed twice
    root = loadfile_on_two_workers.rootpath
    assert all((root / test_file).is_file() for test_file in conftest.SHARED_RUNS)
    loadfile_on_two_workers.option.dist = "load"  # `make test-fast`: one test at a time
    assert conftest.pytest_xdist_make_scheduler(config=loadfile_on_two_workers, log=None) is None
