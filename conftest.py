"""Test-wide setup: 8 fake CPU devices for JAX, set before any JAX operation; strict numerics;
each program compiled once per process."""

import contextlib
import importlib.util
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Strict: an implicit dtype promotion or rank broadcast in the project's code is an error.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

from testkit.compile_cache import each_program_compiled_once  # noqa: E402

# Each test process compiles each program once (tests build their train steps afresh): JAX's
# persistent cache, in a temporary directory of this process, for the whole session (with
# JAX_COMPILATION_CACHE_DIR set, that cache is used as it is, with JAX's thresholds).
_SESSION = contextlib.ExitStack()


def pytest_configure(config):
    _SESSION.enter_context(each_program_compiled_once())


def pytest_unconfigure(config):
    _SESSION.close()


# examples/ are lessons and scripts: examples/lessons_test.py runs them as a user
# would; --doctest-modules must not import them as modules.
collect_ignore_glob = ["examples/[0-9][0-9]_*.py", "examples/_common.py", "examples/flax_lm/train.py",
                       "examples/flax_lm/linen_train_state.py", "benchmarks/__main__.py",
                       "parity_tests/__main__.py", "testkit/multihost_worker.py",
                       "jax_trainers/__main__.py"]  # fmt: skip
# The JAX trainers' harness imports them (their own environment, `make jax-trainers`); without
# them its test module is one skip with that reason (jax_trainers/trainers_test.py).
if importlib.util.find_spec("tunix") is None or importlib.util.find_spec("maxtext") is None:
    collect_ignore_glob += ["jax_trainers/tunix_*.py", "jax_trainers/maxtext_*.py"]


# Without torch (`make test-latest`: Python 3.12 has no CPU build of it here), the
# packages that need it are one skipped test each, with that reason, instead of an
# import error: their __init__ imports torch, so a module-level importorskip cannot run.
NEEDS_TORCH = {"torch_ref"}
NO_TORCH = "needs torch: no CPU build for this Python here (make test-latest runs without it)"
# Modules with torch at import time outside those packages (test modules importorskip it).
if importlib.util.find_spec("torch") is None:
    collect_ignore_glob += ["parity_tests/audits.py", "parity_tests/suite.py",
                            "parity_tests/run_torch.py", "parity_tests/torch_*.py",
                            "parity_tests/trl_table.py", "parity_tests/trl_prediction.py",
                            "parity_tests/stress.py"]  # fmt: skip


class _SkippedPackage(pytest.Directory):
    def collect(self):
        yield _Skipped.from_parent(self, name="needs_torch")


class _Skipped(pytest.Item):
    def runtest(self):
        pytest.skip(f"{self.parent.path.name}/: {NO_TORCH}")

    def reportinfo(self):
        return self.path, None, f"{self.path.name}: {NO_TORCH}"


def pytest_collect_directory(path, parent):
    if path.name in NEEDS_TORCH and path.parent == parent.config.rootpath:
        if importlib.util.find_spec("torch") is None:
            return _SkippedPackage.from_parent(parent, path=path)
    return None


# Docstring examples that run a whole audit or build a model (seconds each): `make test` only.
SLOW_DOCTESTS = {"jaxaccum.audit.audit_window", "torch_ref._audit_window.audit_window",
                 "tinygpt.flax_gpt"}  # fmt: skip


def pytest_collection_modifyitems(items):
    for item in items:
        if isinstance(item, pytest.DoctestItem) and item.name in SLOW_DOCTESTS:
            item.add_marker(pytest.mark.slow)


# Test files that read the same runs (examples/_headlines.py: each lesson and the Flax
# example's 25 updates, run once per process): `--dist loadfile` hands them to one worker
# together, so `make test` computes each run once, not once per worker.
SHARED_RUNS = {"examples/lessons_test.py", "examples/docs_numbers_test.py",
               "examples/flax_lm/flax_lm_test.py"}  # fmt: skip


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: called only with `-n`
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for that mode
    from xdist.scheduler import LoadFileScheduling

    class SharedRunsOnOneWorker(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            test_file = super()._split_scope(nodeid)
            return "examples/_headlines.py" if test_file in SHARED_RUNS else test_file

    return SharedRunsOnOneWorker(config, log)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """torch on one intra-op thread in tests that use it: the tiny models gain nothing
    from more, and on small hosts 2 OpenMP threads make every op far slower."""
    if "torch" not in sys.modules:
        yield
        return
    from torch_ref import one_cpu_thread

    with one_cpu_thread():
        yield
