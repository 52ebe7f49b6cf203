"""Every number quoted in the docs is the named export of the code that prints it.

**Marker syntax.** In ``README.md``, ``docs/*.md``, ``examples/README.md`` and
``examples/flax_lm/README.md`` a quoted number is followed, with no space, by
an HTML comment (GitHub renders it as nothing) that names its source and its
name::

    each short-sample token weighs 1/20<!-- 01:short_token_weight -->

* source ``NN``: the lesson ``examples/NN_*.py``; the name is a key of its
  ``HEADLINE`` mapping, filled by its ``main()`` (which asserts the numbers);
* source ``flax_lm``: the 25-update run of ``examples/flax_lm/train.py``
  (``_headlines.flax_lm``: its ``main`` asserts jaxaccum against the big batch).

The text right before the marker must be the export, exactly, and a whole
number (``11/20`` does not quote ``1/20``). An export may be a list
(``0.42, 0.40, 0.44, 0.41``) or carry its unit (``0.99%``); a unit the export
does not print stays after the marker (``27.5<!-- 03:local_over_big_0 -->x``).

Two other markers:

* ``2<!-- time: make demo, minutes -->``: a timing, left to whoever times it
  (how long ``make demo`` takes); not checked, and it covers the one number
  before it;
* ``<!-- output: 09 -->`` on the line before a fenced block: every line of the
  block but ``...`` is a line that source printed (a number below 1e-04 printed as
  ``8.5e-07``, float32's rounding, by its order: :data:`AT_ROUNDING`).

**No number of the prose is left unmarked**, except (``_headlines.NOT_QUOTED``):

1. code blocks, inline code and other HTML comments: code, not a quoted result
   (the marked blocks of ``README.md`` and ``docs/data-parallel.md`` run in
   ``jaxaccum/_docs_test.py``; an ``<!-- output: ... -->`` block is checked above);
2. link targets, and link texts that only name a section, a lesson or a file
   (``[3](#3-...)``, ``[01](...)``, ``[lesson 1](...)``): addresses, not results;
3. section numbers of headings, list numbering, and references (``section 5``,
   ``lessons 3 and 8``, ``TRL issue 2175``): they number the text, not a result;
4. file names, dates, versions (``jax 0.10.2``, ``Python 3.11``), and names or
   formulas with a digit in them (``ZeRO-1``, ``fp16``, ``2-D``, ``1/k``): names;
5. the window's shape, a single digit next to what it counts (``k = 4``,
   ``R=1``, ``4 devices``, ``2 processes``): the set-up a reader reads in the
   lesson's code, not a result; the sizes of the data (``10 and 1000 valid
   tokens``) are exported and marked;
6. files whose numbers another check owns: ``docs/benchmarks.md``, written
   whole by ``python -m benchmarks`` from one run's measurements (its prose is
   formatted from them too), and its GPU run's ``docs/benchmarks-gpu.md``;
   ``docs/parity-gpu.md``, written by ``python -m benchmarks.gpu_report`` from
   that run's records (``benchmarks/bench_test.py``); the table rows of
   ``docs/bad-inputs.md``, each one checked by ``jaxaccum/_bad_input_test.py``;
7. a generated block, from ``<!-- NAME: begin ... -->`` to ``<!-- NAME: end -->``:
   its generator writes it and its test checks it is what the code produces
   (``docs/trl-invariance.md``'s table: ``parity_tests/trl_table_test.py``;
   ``docs/audit.md``'s cost table, rendered from the measurements kept in
   ``docs/audit-cost.json``: ``benchmarks/bench_test.py``).

A document that quotes a lesson needing what is not installed (``_headlines.NEEDS``:
lesson 10 runs TRL) is skipped.
"""

from __future__ import annotations

import re

import _headlines
import pytest

pytestmark = pytest.mark.slow  # processes, or minutes of compiling: `make test` only

SOURCES = {p.name[:2] for p in _headlines.LESSONS} | {"flax_lm"}
GENERATED = {  # and how each says so
    "docs/benchmarks.md": "Written by `python -m benchmarks",
    "docs/benchmarks-gpu.md": "Written by `python -m benchmarks",  # the GPU run's section 6
    "docs/parity-gpu.md": "Written by `python -m benchmarks.gpu_report`",  # from its records
}
TABLES_CHECKED_ELSEWHERE = {"docs/bad-inputs.md"}


AT_ROUNDING = re.compile(r"\b\d\.\d+e-(0[5-9]|[1-9]\d)\b")
"""A number below 1e-04 printed as ``d.de-05`` or smaller, float32's rounding: its digits
differ from one CPU to another (lesson 09's residual reads 8.5e-07 on one and 8.6e-07 on
another), its order does not. An output block is compared to the print by that order."""


def at_rounding(line: str) -> str:
    """``line`` with each number of float32's rounding replaced by its order."""
    return AT_ROUNDING.sub(lambda m: f"?e-{m[1]}", line.rstrip())


def value_of(marker: _headlines.Marker) -> str | None:
    if marker.source not in SOURCES:
        return None
    return _headlines.run(marker.source).exports.get(marker.name)


def text(doc: str) -> str:
    return (_headlines.ROOT / doc).read_text()


def skip_unless_runnable(doc: str) -> None:
    _headlines.skip_unless_runnable(m.source for m in _headlines.markers(text(doc)))
    _headlines.skip_unless_runnable(source for source, _ in _headlines.output_blocks(text(doc)))


@pytest.mark.parametrize("doc", _headlines.DOCUMENTS)
def test_markers_quote_their_exports(doc):
    skip_unless_runnable(doc)
    wrong = []
    for m in _headlines.markers(text(doc)):
        value = value_of(m)
        if value is None:
            wrong.append(f"{doc}:{m.line}: {m.source}:{m.name} is no export")
        elif not m.quotes(value):
            wrong.append(f"{doc}:{m.line}: {m.source}:{m.name} is {value!r}: {m.before[-40:]!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "doc",
    [doc for doc in _headlines.DOCUMENTS if doc not in GENERATED],
)
def test_no_number_is_left_unmarked(doc):
    skip_unless_runnable(doc)
    found = _headlines.unmarked_numbers(
        text(doc), value_of, skip_tables=doc in TABLES_CHECKED_ELSEWHERE
    )
    assert not found, "numbers without a marker:\n" + "\n".join(
        f"{doc}:{line}: {number}   in: {context}" for line, number, context in found
    )


@pytest.mark.parametrize("doc", _headlines.DOCUMENTS)
def test_output_blocks_are_what_their_source_prints(doc):
    skip_unless_runnable(doc)
    for source, lines in _headlines.output_blocks(text(doc)):
        printed = {at_rounding(line) for line in _headlines.run(source).output.splitlines()}
        missing = [line for line in lines if at_rounding(line) not in printed]
        assert not missing, f"{doc}: lines that {source} does not print:\n" + "\n".join(missing)


def test_generated_docs_say_so():
    for doc, says in GENERATED.items():
        assert says in text(doc).split("\n", 3)[2], doc


def test_every_lesson_is_quoted():
    quoted = {m.source for doc in _headlines.DOCUMENTS for m in _headlines.markers(text(doc))}
    assert SOURCES <= quoted, sorted(SOURCES - quoted)
