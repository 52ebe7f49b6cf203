"""The site's source tree, assembled from the repository's own files (``make docs``).

Sphinx reads one source directory (``out/docs-src``). The pages live where a
code host shows them (``README.md``, ``docs/*.md``, ``examples/flax_lm/README.md``,
``CHANGELOG.md``), so they are copied there with their relative paths kept (their
links work unchanged), with the files they link to (images, scripts: download
links on the site). The site's own pages (``docs/_site/index.md``, ``api/``) go to
the top, with a page per public module (``public_api.page``). Each lesson
``examples/NN_*.py`` is handed to sphinx-gallery in the form it reads
(:func:`lesson_for_gallery`), with a title card as its thumbnail unless it draws
a figure of its own. A file is written only when its content changed, so Sphinx
reads again only the pages that changed (the lessons run at every build).
"""

from __future__ import annotations

import json
import pathlib
import re

import _headlines
import public_api

ROOT = _headlines.ROOT
SITE = ROOT / "docs" / "_site"
# The pages of the repository shown on the site, as paths relative to ROOT.
PAGES = ["README.md", "CHANGELOG.md", "examples/flax_lm/README.md"] + sorted(
    f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")
)
LESSONS_SOURCE = "_lessons"  # where sphinx-gallery reads the lessons (under the source tree)
LESSONS = "lessons"  # where it writes their pages
LESSON_PATHS = _headlines.LESSONS  # examples/NN_*.py, in order
LESSON_TAIL = 'if __name__ == "__main__":\n    raise SystemExit(main())\n'
# A lesson that needs what the site's environment lacks (``_headlines.NEEDS``: lesson 11 runs
# Tunix) is shown with the output its own environment recorded: the record, the key of the
# output in it, and the make target that checks the record against a fresh run.
RECORDED = {"11": ("docs/jax-trainers.json", "lesson_11", "make jax-trainers")}
# A Markdown link's target: ](target) or ](target#anchor)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def recorded_output(number: str) -> str:
    """The gallery's last block for a lesson it does not run: the output its own
    environment recorded, with where and when (``RECORDED``)."""
    record, key, target = RECORDED[number]
    data = json.loads((ROOT / record).read_text())
    needs = ", ".join(f"``{m}``" for m in _headlines.NEEDS[number])
    lines = [
        f"This lesson needs {needs}, which the site's environment does not hold: it runs in the",
        f"environment of ``{target}``, which checks the output below (recorded on",
        f"{data['date']}, ``{record}``) against a fresh run.",
        "",
        ".. code-block:: text",
        "",
        *("   " + line if line else "" for line in data[key].rstrip().splitlines()),
    ]
    return "# %%\n" + "".join(f"# {line}\n" if line else "#\n" for line in lines)


def write_if_changed(path: pathlib.Path, content: str | bytes) -> pathlib.Path:
    """Writes ``content`` to ``path`` unless it holds it already; returns ``path``."""
    data = content.encode() if isinstance(content, str) else content
    if not path.exists() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return path


def linked_files(page: str) -> list[str]:
    """The repository files (not pages, not lessons) that Markdown ``page`` links to.

    >>> "examples/flax_lm/train.py" in linked_files("examples/flax_lm/README.md")
    True
    """
    found = set()
    base = (ROOT / page).parent
    for target in LINK.findall((ROOT / page).read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (base / target).resolve()
        if path.is_file() and path.suffix != ".md" and path not in LESSON_PATHS:
            found.add(path.relative_to(ROOT).as_posix())
    return sorted(found)


def lesson_for_gallery(source: str, script: str, recorded: str | None = None) -> str:
    """A lesson as sphinx-gallery reads it: its docstring's first line a title, the rest
    reStructuredText, and ``main()`` run and asserted in a block of its own.

    The lesson ends with ``raise SystemExit(main())`` under ``__main__``, which in
    the build's process would end the build: here its last block asserts
    ``main() == 0`` instead (``main`` asserts every number it prints). Indented
    blocks of the docstring become literal blocks. A lesson the site cannot run ends
    with its ``recorded`` output instead (:func:`recorded_output`).

    >>> lesson = '\"\"\"Lesson 0: a title.\\n\\nText.\\n\\n    python x.py\\n\"\"\"\\n\\n'
    >>> print(lesson_for_gallery(lesson + "def main():\\n    return 0\\n\\n\\n" + LESSON_TAIL,
    ...                          "examples/00_x.py"))
    \"\"\"Lesson 0: a title
    =================
    <BLANKLINE>
    Text.
    <BLANKLINE>
    ::
    <BLANKLINE>
        python x.py
    \"\"\"
    <BLANKLINE>
    def main():
        return 0
    <BLANKLINE>
    <BLANKLINE>
    # %%
    # ``python examples/00_x.py`` runs ``main()``: it prints the lesson's numbers below and
    # asserts every one of them (a wrong number stops the build of this page).
    <BLANKLINE>
    assert main() == 0
    <BLANKLINE>
    """
    if not source.startswith('"""') or not source.endswith(LESSON_TAIL):
        raise ValueError(
            f"{script}: a lesson starts with its docstring and ends with"
            f" {LESSON_TAIL!r}; the site's gallery runs it that way."
        )
    docstring, code = source[3:].split('"""', 1)
    title, text = docstring.split("\n", 1)
    title = title.rstrip(".")
    # an indented block after a paragraph: a literal block (a lone "::" is not shown)
    text = re.sub(r"\n\n(    \S)", r"\n\n::\n\n\1", text)
    body = code[: -len(LESSON_TAIL)]
    run = recorded
    if recorded is None:
        run = (
            f"# %%\n# ``python {script}`` runs ``main()``: it prints the lesson's numbers below"
            " and\n# asserts every one of them (a wrong number stops the build of this page).\n\n"
            "assert main() == 0\n"
        )
    return f'"""{title}\n{"=" * len(title)}\n{text}"""{body}{run}'


def title_card(number: str) -> bytes:
    """A lesson's thumbnail, its number (its title is under it), as PNG bytes (400 x 280)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(4.0, 2.8), dpi=100, facecolor="#eef2fa")
    figure.text(0.1, 0.72, "lesson", fontsize=24, color="#5a6b8c")
    figure.text(0.1, 0.18, number, fontsize=100, weight="bold", color="#2b5797")
    out = io.BytesIO()
    figure.savefig(out, format="png", metadata={"Software": None})
    return out.getvalue()


def stage_lessons(srcdir: pathlib.Path) -> list[pathlib.Path]:
    """The lessons, their thumbnails and the gallery's header, under ``srcdir/_lessons``."""
    written = [write_if_changed(srcdir / LESSONS_SOURCE / "GALLERY_HEADER.rst",
                                (SITE / "lessons_header.rst").read_text())]  # fmt: skip
    for path in LESSON_PATHS:
        source = path.read_text()
        number = path.name[:2]
        recorded = None if _headlines.runnable(number) else recorded_output(number)
        lesson = lesson_for_gallery(source, f"examples/{path.name}", recorded)
        if "matplotlib" not in source:  # no figure of its own: a title card
            card = f"{LESSONS_SOURCE}/thumbnails/{path.stem}.png"
            written.append(write_if_changed(srcdir / card, title_card(number)))
            lesson += f'\n# sphinx_gallery_thumbnail_path = "{card}"\n'
        written.append(write_if_changed(srcdir / LESSONS_SOURCE / path.name, lesson))
    return written


def stage(srcdir: pathlib.Path) -> None:
    """Assembles the source tree in ``srcdir``; removes what a previous run left that is
    gone from the repository (sphinx-gallery's output, ``lessons/``, is its own)."""
    srcdir = pathlib.Path(srcdir)
    written = []
    for page in PAGES:
        for name in [page, *linked_files(page)]:
            written.append(write_if_changed(srcdir / name, (ROOT / name).read_bytes()))
    for path in sorted(SITE.rglob("*")):
        if path.suffix in (".md", ".rst") and path.name != "lessons_header.rst":
            name = path.relative_to(SITE)
            written.append(write_if_changed(srcdir / name, path.read_bytes()))
    for module_name in public_api.PUBLIC_MODULES:
        written.append(
            write_if_changed(srcdir / "api" / f"{module_name}.rst", public_api.page(module_name))
        )
    written += stage_lessons(srcdir)
    for path in sorted(srcdir.rglob("*"), reverse=True):
        if path.parts[len(srcdir.parts)] == LESSONS or path in written:
            continue
        if path.is_file():
            path.unlink()
        elif not any(path.iterdir()):
            path.rmdir()
