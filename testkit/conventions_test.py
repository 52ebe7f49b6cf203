"""The repository's conventions that a test can check: a module, a function, reads as one page.

Every non-test module tracked by git (``*.py`` but ``*_test.py`` and ``conftest.py``)
is at most `MAX_MODULE_LINES` lines: one idea per module, split along its ideas when
it grows. Every function, tests included, has at most `MAX_FUNCTION_LINES` lines of
code (blank lines, comments and its docstring not counted).
"""

from __future__ import annotations

import ast
import io
import pathlib
import shutil
import subprocess
import textwrap
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 50
MAX_BENCHMARK_FUNCTION_LINES = 80  # a benchmark's function writes a whole table
# being split in another branch: the lead removes these on merge
BEING_SPLIT: set[str] = set()


def tracked_python_files() -> list[str]:
    """Every ``*.py`` git tracks (and the work tree holds), paths relative to the root."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a clone of the repository (git ls-files)")
    listed = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=True)  # fmt: skip
    return [p for p in listed.stdout.split("\0") if p and (ROOT / p).exists()]


def module_lengths() -> dict[str, int]:
    """``{path: lines}`` of every non-test module git tracks, paths relative to the root."""
    modules = [
        p
        for p in tracked_python_files()
        if not p.endswith("_test.py") and pathlib.Path(p).name != "conftest.py"
    ]
    return {p: len((ROOT / p).read_text().splitlines()) for p in modules}


def code_lines(source: str, function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The function's lines that hold code (a token of a statement: every line of a
    multi-line string too), its decorators included; not its docstring, comments or blanks."""
    first = function.body[0]
    docstring = set()
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        docstring = set(range(first.lineno, first.end_lineno + 1))
    start = min([function.lineno] + [d.lineno for d in function.decorator_list])
    lines = source.splitlines(keepends=True)[start - 1 : function.end_lineno]
    text = textwrap.dedent("".join(lines))
    held = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                              tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):  # fmt: skip
            held.update(range(token.start[0] + start - 1, token.end[0] + start))
    return len(held - docstring)


def function_lengths(path: str) -> dict[str, int]:
    """``{"path:line name": code lines}`` of every function (methods, nested ones) in a file."""
    source = (ROOT / path).read_text()
    functions = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    return {f"{path}:{f.lineno} {f.name}": code_lines(source, f) for f in functions}


def test_every_module_reads_as_one_page():
    lengths = module_lengths()
    assert len(lengths) > 50  # not vacuous: the library, the reference, the suite, the lessons
    too_long = {p: n for p, n in lengths.items() if n > MAX_MODULE_LINES and p not in BEING_SPLIT}
    assert not too_long, "modules over {} lines (split them along their ideas): {}".format(
        MAX_MODULE_LINES, ", ".join(f"{p} ({n} lines)" for p, n in sorted(too_long.items()))
    )


def test_every_function_reads_as_one_page():
    lengths = {}
    for path in tracked_python_files():
        lengths.update(function_lengths(path))
    assert len(lengths) > 500  # not vacuous: every module's functions
    limit = lambda f: (
        MAX_BENCHMARK_FUNCTION_LINES if f.startswith("benchmarks/") else MAX_FUNCTION_LINES
    )
    too_long = {f: n for f, n in lengths.items() if n > limit(f)}
    assert not too_long, (
        "functions over {} code lines ({} in benchmarks/; give a step its own function): {}".format(
            MAX_FUNCTION_LINES,
            MAX_BENCHMARK_FUNCTION_LINES,
            ", ".join(f"{f} ({n})" for f, n in sorted(too_long.items())),
        )
    )


def test_a_function_counts_its_code_not_its_docstring_or_comments():
    source = 'def f():\n    """Doc.\n\n    More.\n    """\n    # note\n\n    x = 1\n    return x\n'
    (function,) = ast.parse(source).body
    assert code_lines(source, function) == 3  # def, x = 1, return x


def test_a_function_counts_its_decorators_and_every_line_of_a_string():
    source = '@decorator\ndef f():\n    text = """a\n\n# not a comment\n"""\n    return text\n'
    (function,) = ast.parse(source).body
    assert code_lines(source, function) == 7  # the decorator, def, the string's 4 lines, return


def test_the_modules_being_split_are_still_long():
    # an entry whose module was split (or removed) must leave the allow-list
    lengths = module_lengths()
    done = {p: lengths.get(p) for p in BEING_SPLIT if lengths.get(p, 0) <= MAX_MODULE_LINES}
    assert not done, f"remove from BEING_SPLIT (now at most {MAX_MODULE_LINES} lines): {done}"
