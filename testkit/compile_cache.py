"""Each program compiled once: JAX's persistent compilation cache in a temporary directory.

A test, like each trainer's audited run, builds its train step afresh, so ``jit``'s
in-memory cache, keyed by the function object, misses even for a program compiled before.
The persistent cache keys an executable by its whole program, compiler options, devices,
XLA flags and versions, so only the same program is reused, and the executable read back
is the one XLA compiled (its HLO text differs only in the metadata's stack-frame numbering,
which :mod:`testkit.hlo` does not read).

``conftest.py`` holds it open for each test process (``make test``); ``jax_trainers.table``
for the trainers' audits when they run on their own (``python -m jax_trainers``).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

CACHE_EVERY_PROGRAM = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}
"""JAX's thresholds of the persistent cache, lowered so that it keeps every program (-1: no
size limit, and none that a file system overrides)."""


@contextlib.contextmanager
def each_program_compiled_once() -> Iterator[None]:
    """JAX's persistent compilation cache in a temporary directory of this process, for the
    block (one process writes it, so no two write an entry at once).

    The directory is removed at the end and JAX's options are restored; a cache directory
    set already (``JAX_COMPILATION_CACHE_DIR``, or an enclosing block) is left as it is.
    """
    if jax.config.jax_compilation_cache_dir is not None:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="jaxaccum-programs-") as directory:
        settings = {**CACHE_EVERY_PROGRAM, "jax_compilation_cache_dir": directory}
        before = {name: getattr(jax.config, name) for name in settings}
        _configure_cache(settings)
        try:
            yield
        finally:
            _configure_cache(before)


def _configure_cache(settings: dict) -> None:
    """Sets JAX's options and has its compilation cache read them again."""
    for name, value in settings.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
