"""Shared set-up for the lessons: CPU, fake devices, and one way to print a weight.

Import it before JAX does anything: ``import _common`` is the first import of
every lesson, so that ``python examples/NN_*.py`` runs on the CPU with enough
fake devices, and the lessons test (where ``conftest.py`` already asked for 8)
is left alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402


def use_cpu_devices(n: int) -> None:
    """Makes sure JAX has at least ``n`` (fake CPU) devices.

    Sets ``jax_num_cpu_devices`` when the backends are not initialized yet and
    the current setting is smaller; never lowers it (the test suite asks for 8).
    """
    if jax.config.jax_num_cpu_devices < n:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:
            pass  # backends already up: check below what we have
    if len(jax.devices()) < n:
        raise RuntimeError(
            f"this lesson needs {n} JAX devices, found {len(jax.devices())}; run it"
            " as a script (it sets jax_num_cpu_devices) or set"
            f" jax.config.update('jax_num_cpu_devices', {n}) before any JAX operation."
        )


def fraction(weight: float) -> str:
    """``0.05`` -> ``'1/20'``: a token weight as one over an integer."""
    return f"1/{1.0 / weight:.0f}"


def is_one_over(weight: float, n: int, rel: float = 1e-5) -> bool:
    """Whether ``weight`` is ``1/n`` up to float32 rounding (``rel``)."""
    return abs(weight * n - 1.0) <= rel
