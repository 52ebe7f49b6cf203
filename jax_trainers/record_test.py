"""The recorded run of the JAX trainers (``docs/jax-trainers.json``) and what shows it.

Runs everywhere (numpy only): the trainers themselves run in ``trainers_test.py``, under
``make jax-trainers``, which also checks this record against a fresh run.
"""

from __future__ import annotations

import ast
import pathlib

from jax_trainers import table
from parity_tests import docs_blocks


def test_the_docs_table_is_the_record():
    documented = docs_blocks.block(table.DOC.read_text(), table.BLOCK)
    assert documented == table.recorded_block(), "run python -m jax_trainers --write"


def test_every_recorded_verdict_is_the_expected_one():
    _, rows = table.recorded()
    expected = {(t, r, c) for (t, r), configs in table.EXPECTED.items() for c in configs}
    assert {(r.trainer, r.route, r.config) for r in rows} == expected
    assert [r for r in rows if not table.matches(r)] == []


def test_the_demo_shows_the_rows_as_recorded_with_date_and_versions():
    header, rows = table.recorded()
    text = table.demo()
    assert "RECORDED" in text and header["date"] in text
    assert all(f"{name} {v}" in text for name, v in header["versions"].items())
    assert all(row.verdict in text for row in rows)


def test_the_recorded_lesson_quotes_the_fix_as_its_source_reads():
    # lesson 11 prints the fix's source: an edit to it needs `make jax-trainers-record` (here
    # without Tunix, read from the files, so an edit fails `make test` before CI's fresh run)
    recorded = table.recorded_lesson_output()
    for path, name in [("tunix_sft.py", "summed_loss"), ("tunix_fix.py", "ExactPeftTrainer")]:
        source = (pathlib.Path(table.__file__).parent / path).read_text()
        node = next(n for n in ast.parse(source).body if getattr(n, "name", None) == name)
        quoted = ast.get_source_segment(source, node)
        assert quoted in recorded, f"{path}:{name} changed: run make jax-trainers-record"
