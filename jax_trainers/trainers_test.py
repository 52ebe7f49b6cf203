"""Tunix and MaxText as they ship: every verdict of the table, measured now, and the record.

Needs the trainers' environment (``make jax-trainers``: ``.venv-jax-trainers``); elsewhere
every test here is skipped with that reason. One module-wide run of `table.run_all`
(Tunix here, MaxText in a process per device count: several minutes on 2 cores) feeds
them all.
"""

from __future__ import annotations

import math
import re

import pytest

import jax_trainers  # noqa: F401  (sets the Hub offline before the trainers are imported)

NEEDS = "needs google-tunix 0.1.7 and maxtext 0.2.5: make jax-trainers (.venv-jax-trainers)"
pytest.importorskip("tunix", reason=NEEDS)
pytest.importorskip("maxtext", reason=NEEDS)

from jax_trainers import table  # noqa: E402

pytestmark = pytest.mark.slow

WEIGHT_RTOL = 1e-3
"""A recorded weight against a fresh one: the audit's own tolerance of a form's weight
(float32 gradients, the update read back as new - old: ~1e-6 apart in practice)."""
NOISE = 1e-5
"""An exact or invariant update's distance from its reference: float32 rounding (~1e-6);
``bigbatch.INVARIANCE_RTOL``."""


@pytest.fixture(scope="module")
def fresh():
    return table.run_all()


def key(row):
    return row.trainer, row.route, row.config


def test_every_configuration_of_the_table_is_measured(fresh):
    measured = {key(row) for row in fresh}
    expected = {(t, r, c) for (t, r), configs in table.EXPECTED.items() for c in configs}
    assert measured == expected


def test_each_verdict_is_the_one_the_trainers_code_predicts(fresh):
    wrong = [
        f"{key(r)}: {r.verdict}, expected {table.expected(r)}"
        for r in fresh
        if not table.matches(r)
    ]
    assert not wrong, "\n".join(wrong)


def test_every_fix_is_the_big_batch(fresh):
    for row in fresh:
        if row.route != "as shipped":
            assert row.verdict == "exact" and row.error <= NOISE, row
            assert all(w is None or abs(w - 1) <= WEIGHT_RTOL for w in row.weights), row


def test_the_record_is_a_fresh_run(fresh):
    # docs/jax-trainers.json (the demo's rows, the docs' table) is what the trainers do now
    header, recorded = table.recorded()
    assert [key(r) for r in recorded] == [key(r) for r in fresh]
    for old, new in zip(recorded, fresh, strict=True):
        assert old.verdict == new.verdict, key(new)
        assert len(old.weights) == len(new.weights), key(new)
        for a, b in zip(old.weights, new.weights, strict=True):
            assert (a is None) == (b is None) and (
                a is None or math.isclose(a, b, rel_tol=WEIGHT_RTOL)
            )
        if old.error <= NOISE or new.error <= NOISE:  # both float32 rounding
            assert max(old.error, new.error) <= NOISE, key(new)
        elif not math.isnan(new.error):
            assert math.isclose(old.error, new.error, rel_tol=WEIGHT_RTOL), key(new)


def same_but_rounding(text: str) -> str:
    """``text`` with its numbers in e-notation (residuals, errors: float32 rounding) masked."""
    return re.sub(r"\d\.\d+e[+-]\d+", "<e>", text)


def test_the_recorded_lesson_output_is_a_fresh_run():
    # the site shows lesson 11's recorded output where Tunix is not installed
    fresh = same_but_rounding(table.lesson_output())
    assert fresh == same_but_rounding(table.recorded_lesson_output())
