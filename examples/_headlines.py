"""The headline numbers of the lessons and of the Flax example, and the docs' markers.

Every number quoted in the prose of the docs is followed by a marker that names
its source and its name (the syntax and its exceptions: ``docs_numbers_test.py``).
This module runs each source once per process and hands out what it exports:

* lesson ``NN`` (``examples/NN_*.py``): its ``HEADLINE`` mapping, name -> the
  string the lesson prints, filled by ``main()`` (which asserts the numbers);
* ``flax_lm``: the 25-update run of ``examples/flax_lm/train.py`` (its ``main``,
  which asserts jaxaccum against the big batch) and the settings it ran with.

It also reads the markers (:func:`markers`), the prose numbers that no marker
covers (:func:`unmarked_numbers`) and the blocks that quote a source's output
(:func:`output_blocks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import io
import math
import pathlib
import re
import sys
import tempfile
from collections.abc import Callable, Iterable

from testkit import standard_numerics

EXAMPLES = pathlib.Path(__file__).resolve().parent
ROOT = EXAMPLES.parent
LESSONS = sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))
FLAX_LM = EXAMPLES / "flax_lm"
# What a lesson needs beyond JAX (the optional extras): without it, its runs are skipped.
NEEDS = {"10": ("torch", "transformers", "trl", "datasets"), "11": ("tunix",)}

# The documents whose numbers are checked (paths relative to ROOT).
DOCUMENTS = sorted(
    ["README.md", "examples/README.md", "examples/flax_lm/README.md", "docs/_site/index.md"]
    + [f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")]
)

# 1/20<!-- 01:short_token_weight -->: the source (a lesson's number, or flax_lm) and a name.
MARKER = re.compile(r"<!-- (?P<source>\d\d|flax_lm):(?P<name>\w+) -->")
# 2<!-- time: make demo, minutes -->: a timing, left to whoever times it (not checked).
TIME_MARKER = re.compile(r"<!-- time:[^>]*-->")
# <!-- output: 09 --> on the line before a ``` block: its lines are lines the source printed.
OUTPUT_MARKER = re.compile(r"<!-- output: (?P<source>\d\d|flax_lm) -->\n```[^\n]*\n(.*?)```", re.S)
# A number: 1/20, 0.42, 27.5 (of 27.5x), 50.00 (of 50.00%), 65536, 1e-6, 2.6e-06 ...
NUMBER = re.compile(r"\d+(?:\.\d+)*(?:e[-+]?\d+)?(?:/\d+)?")


@dataclasses.dataclass(frozen=True)
class Run:
    """What a source exported (name -> the string it prints) and everything it printed."""

    exports: dict[str, str]
    output: str


def _load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_main(main: Callable[[], int]) -> str:
    """Runs an example's ``main()`` as a user would; what it printed (it must return 0)."""
    out = io.StringIO()
    # an example is user code: JAX's default promotion rules (conftest.py is strict)
    with contextlib.redirect_stdout(out), standard_numerics():
        status = main()
    assert status == 0, f"{main.__module__}.main() returned {status}"
    return out.getvalue()


@functools.cache
def lesson(number: str) -> Run:
    """Runs lesson ``number`` (``"01"``...) once; its ``HEADLINE`` and its output."""
    (path,) = [p for p in LESSONS if p.name.startswith(f"{number}_")]
    module = _load(path, f"lesson_{path.stem}")
    output = run_main(module.main)
    headline = getattr(module, "HEADLINE", None)
    assert isinstance(headline, dict) and headline, f"{path.name} exports no HEADLINE"
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in headline.items())
    return Run(dict(headline), output)


def load_flax_lm(name: str):
    """``examples/flax_lm/<name>.py`` as a module (``train.py`` imports ``_report``)."""
    return _load(FLAX_LM / f"{name}.py", f"flax_lm_{name}")


def _power_of_ten_above(x: float) -> str:
    """``3.5e-06`` -> ``'1e-05'``."""
    return f"{10.0 ** math.ceil(math.log10(x)):.0e}"


@functools.cache
def flax_lm() -> Run:
    """The Flax example as its README shows it: ``train.py``'s 25 updates, once.

    ``main`` runs the three pipelines and asserts jaxaccum against the big
    batch (its ``TOLERANCE``); the plot goes to a temporary file. The exports
    are formatted as ``main`` prints them.
    """
    train, linen = load_flax_lm("train"), load_flax_lm("linen_train_state")
    histories = []
    run_train = train.train
    train.train = lambda *a, **kw: histories.append(run_train(*a, **kw)) or histories[-1]
    with tempfile.TemporaryDirectory() as tmp:
        output = run_main(
            lambda: train.main(["--no-progress", "--plot", str(pathlib.Path(tmp) / "curves.png")])
        )
    (h,) = histories
    s, config = train.Settings(), train.CONFIG
    exports = {
        "updates": str(s.updates),
        "samples_per_update": str(s.samples_per_update),
        "n_layer": str(config.n_layer),
        "n_head": str(config.n_head),
        "d_model": str(config.d_model),
        "devices": str(train.DEVICES),
        "max_grad_norm": str(train.MAX_GRAD_NORM),
        "tolerance": f"{train.TOLERANCE:.0e}",
        "first_loss": f"{h['big'][0]:.4f}",
        "big_last_loss": f"{h['big'][-1]:.4f}",
        "jaxaccum_last_loss": f"{h['jaxaccum'][-1]:.4f}",
        "multisteps_last_loss": f"{h['multisteps'][-1]:.4f}",
        "multisteps_first_loss": f"{h['multisteps'][0]:.4f}",
        "multisteps_logged_first_loss": f"{h['multisteps_logged'][0]:.4f}",
        # jaxaccum's distance from the big batch is float32 rounding, whose digits vary with
        # the machine (and the number of fake devices): the power of ten above it
        "max_jaxaccum_below": _power_of_ten_above(max(h["max_jaxaccum"])),
        "rel_jaxaccum_below": _power_of_ten_above(h["rel_jaxaccum"][-1]),
        "max_multisteps": f"{max(h['max_multisteps']):.1e}",
        "rel_multisteps": f"{h['rel_multisteps'][-1]:.1e}",
        # linen_train_state.py (run by flax_lm_test.py): its settings
        "linen_updates": str(linen.UPDATES),
        "linen_k": str(linen.K),
        "linen_tolerance": f"{linen.TOLERANCE:.0e}",
    }
    return Run(exports, output)


def run(source: str) -> Run:
    """The run of a marker's source: ``"01"``... or ``"flax_lm"``."""
    return flax_lm() if source == "flax_lm" else lesson(source)


def runnable(number: str) -> bool:
    """Whether this environment has every module lesson ``number`` needs (`NEEDS`)."""
    return all(importlib.util.find_spec(m) is not None for m in NEEDS.get(number, ()))


def skip_unless_runnable(sources: Iterable[str]) -> None:
    """Inside a test: a skip when one of ``sources`` needs a package that is not installed
    (`NEEDS`, e.g. lesson 10 runs TRL: ``make test-latest`` has no torch)."""
    import pytest

    for source in sorted(set(sources)):
        if not runnable(source):
            missing = [m for m in NEEDS[source] if importlib.util.find_spec(m) is None]
            pytest.skip(f"lesson {source} needs {', '.join(missing)}")


@dataclasses.dataclass(frozen=True)
class Marker:
    """A marker, where it is, and the text of its line before it."""

    line: int
    source: str
    name: str
    before: str

    def quotes(self, value: str) -> bool:
        """Whether the text right before the marker is exactly ``value`` (a whole number)."""
        head = self.before[: len(self.before) - len(value)]
        return self.before.endswith(value) and not re.search(r"[\w.+/-]$", head)


def markers(text: str) -> list[Marker]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for m in MARKER.finditer(line):
            found.append(Marker(number, m["source"], m["name"], line[: m.start()]))
    return found


def output_blocks(text: str) -> list[tuple[str, list[str]]]:
    """``(source, lines)`` of every block after an ``<!-- output: SOURCE -->`` line."""
    return [
        (m["source"], [line.rstrip() for line in m[2].splitlines() if line.strip() != "..."])
        for m in OUTPUT_MARKER.finditer(text)
    ]


# --- the prose and its numbers ------------------------------------------------------------


def _blank(m: re.Match) -> str:
    """A removed span, its line breaks kept (line numbers stay right)."""
    return "\n" * m[0].count("\n")


def _without_code_blocks(text: str) -> str:
    """Fenced blocks and indented (4 spaces, after a blank line) blocks, blanked."""
    lines, fenced, indented = text.split("\n"), False, False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced, lines[i] = not fenced, ""
        elif fenced:
            lines[i] = ""
        else:
            indented = line.startswith("    ") and (indented or i == 0 or not lines[i - 1].strip())
            if indented:
                lines[i] = ""
    return "\n".join(lines)


# Link texts that only name a section, a lesson or a file: [3](#3-...), [01](...), [lesson 1](...)
_REFERENCE_LINK = r"\[(?:(?:examples/|[Ll]esson |[Ss]ection )?\d+(?:-\d+)?|[\w./-]+\.\w+)\]"
# What is not a quoted number (docs_numbers_test.py lists them, with the reasons).
NOT_QUOTED = [
    r"(?s)<!-- ([\w-]+): begin.*?<!-- \1: end -->",  # a generated block: its generator's test
    r"<!--.*?-->",  # the other comments (<!-- test: jit -->, <!-- output: 09 -->)
    _REFERENCE_LINK + r"\([^)]*\)",
    r"\]\([^)]*\)",  # link targets
    r"(?m)^#+ \d+\.",  # section numbers
    r"(?m)^\s*\d+\. ",  # list numbering
    r"\b(?:[Ss]ections?|[Ll]essons?|issue) \d+(?:(?:,| and| to) \d+)*",  # references
    r"[\w/.-]*\.(?:py|md|png|txt|json)\b",  # file names
    r"\b\d{4}-\d\d-\d\d\b",  # dates
    r"\b\d+\.\d+\.\d+(?:\.\d+)*\b",  # versions: 0.10.2
    r"\b(?:Python|JAX|jax|torch|PyTorch|flax|optax) \d+(?:\.\d+)+\+?",  # versions: Python 3.11
    r"\b[kR] ?= ?\d\b",  # structural: k = 4, R=1
    r"\b\d (?:fake )?(?:CPU )?(?:devices|process(?:es)?)\b",  # structural: 4 devices
]


def _is_identifier(text: str, start: int, end: int) -> bool:
    """A digit that is part of a name or a formula: ZeRO-1, fp16, 2-D, 1/k, 1/N."""
    before, after = text[max(0, start - 2) : start], text[end : end + 3]
    return bool(
        re.search(r"[A-Za-z_]-?$", before)
        or re.match(r"/[A-Za-z]|-[A-Z]\b|[A-Za-wyz_]|x[A-Za-z]", after)
    )


def unmarked_numbers(
    text: str, value_of: Callable[[Marker], str | None], *, skip_tables: bool = False
) -> list[tuple[int, str, str]]:
    """``(line, number, the line)`` of each number of the prose that no marker covers.

    ``value_of(marker)`` is the export a marker names (None if there is none);
    the quoted value before a marker is covered when it is that export. A
    ``<!-- time: ... -->`` marker covers the one number before it.
    ``skip_tables``: table rows are checked elsewhere.
    """
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if skip_tables and line.startswith("|"):
            lines[i] = ""
            continue
        for m in reversed(markers(line)):  # markers of this line, right to left
            value = value_of(m)
            cut = len(m.before) - len(value) if value is not None and m.quotes(value) else None
            span = re.search(rf"<!-- {m.source}:{m.name} -->", line[len(m.before) :])
            line = (
                line[: len(m.before) if cut is None else cut] + line[len(m.before) + span.end() :]
            )
        lines[i] = re.sub(NUMBER.pattern + r"\s*" + TIME_MARKER.pattern, "", line)
    prose = _without_code_blocks("\n".join(lines))
    prose = re.sub(r"(`+)(?!`).+?(?<!`)\1(?!`)", _blank, prose, flags=re.S)  # inline code
    for pattern in NOT_QUOTED:
        prose = re.sub(pattern, _blank, prose)
    prose_lines = prose.split("\n")
    found = []
    for number, line in enumerate(prose_lines, 1):
        for m in NUMBER.finditer(line):
            if not _is_identifier(line, m.start(), m.end()):
                found.append((number, m[0], text.split("\n")[number - 1].strip()))
    return found
