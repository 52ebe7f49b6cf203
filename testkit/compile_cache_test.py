"""`testkit.compile_cache.each_program_compiled_once`: what is compiled again is read back,
and JAX's options are as they were afterwards.

The test session holds a cache of its own open (conftest.py); the first two tests set it
aside for their block.
"""

from __future__ import annotations

import contextlib
import os
import threading

import jax
import jax.numpy as jnp
import pytest

from testkit import compile_cache

HIT = "/jax/compilation_cache/cache_hits"
"""The event JAX records when it reads an executable from its persistent cache."""


def compile_anew(program, x) -> None:
    """Jits ``program`` through a new function object, as each trainer does: JAX's in-memory
    caches, keyed by the function, miss."""
    jax.jit(lambda v: program(v)).lower(x).compile()


def events_of(block) -> list[str]:
    """The events JAX records in this thread while ``block()`` runs."""
    events, thread = [], threading.get_ident()
    listener = lambda event, **_: threading.get_ident() == thread and events.append(event)
    jax.monitoring.register_event_listener(listener)
    try:
        block()
    finally:
        jax.monitoring.unregister_event_listener(listener)
    return events


JAX_DEFAULTS = {
    "jax_compilation_cache_dir": None,
    "jax_persistent_cache_min_compile_time_secs": 1.0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}
"""JAX's own settings of the persistent cache: none, as a user without one has it (the test
session's, conftest.py's, is set aside for the block)."""


@contextlib.contextmanager
def jax_options(**settings):
    """JAX's options set to ``settings`` for the block, and put back after it (the session's
    cache, or a user's ``JAX_COMPILATION_CACHE_DIR``), as the module under test sets them."""
    before = {name: getattr(jax.config, name) for name in settings}
    compile_cache._configure_cache(settings)
    try:
        yield
    finally:
        compile_cache._configure_cache(before)


@jax_options(**JAX_DEFAULTS)
def test_a_program_jitted_anew_is_compiled_once_and_another_program_is_compiled():
    x = jnp.arange(8.0)
    thresholds = lambda: {
        name: getattr(jax.config, name) for name in compile_cache.CACHE_EVERY_PROGRAM
    }
    before = thresholds()
    assert before != compile_cache.CACHE_EVERY_PROGRAM  # so that putting them back is seen
    seen = {}

    def block():
        with compile_cache.each_program_compiled_once():
            seen["directory"] = jax.config.jax_compilation_cache_dir
            seen["thresholds"] = thresholds()
            for _ in range(3):
                compile_anew(lambda v: jnp.sin(v) * 3.0, x)
            compile_anew(lambda v: jnp.cos(v) * 3.0, x)

    # the sine's program compiled once and read back twice; the cosine's is another program
    assert events_of(block).count(HIT) == 2
    assert seen["thresholds"] == compile_cache.CACHE_EVERY_PROGRAM
    # afterwards no cache is set and its directory is gone: nothing is left on disk or
    # read from it, and the thresholds are the user's again
    assert jax.config.jax_compilation_cache_dir is None
    assert not os.path.exists(seen["directory"])
    assert thresholds() == before
    # outside the block, nothing is read back
    assert events_of(lambda: compile_anew(lambda v: jnp.sin(v) * 3.0, x)).count(HIT) == 0


def test_a_cache_directory_set_already_is_left_as_it_is(tmp_path):
    # the user's cache stays theirs: neither replaced in the block nor removed after it
    with (
        jax_options(jax_compilation_cache_dir=str(tmp_path)),
        compile_cache.each_program_compiled_once(),
    ):
        inside = jax.config.jax_compilation_cache_dir
    assert inside == str(tmp_path) and tmp_path.exists()


@pytest.mark.skipif(
    bool(os.environ.get("JAX_COMPILATION_CACHE_DIR")),
    reason="JAX_COMPILATION_CACHE_DIR is set: the session uses that cache, with JAX's thresholds",
)
def test_the_session_reads_back_a_program_compiled_anew():
    # conftest.py holds a cache open for the session: a train step a test builds afresh is
    # read back, not compiled again (the first compile may itself be read back: a program
    # an earlier test compiled)
    x = jnp.arange(8.0)
    compile_anew(lambda v: jnp.tan(v) + 1.0, x)
    assert events_of(lambda: compile_anew(lambda v: jnp.tan(v) + 1.0, x)).count(HIT) == 1
