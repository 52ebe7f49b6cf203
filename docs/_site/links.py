"""Links that a code host and the site resolve differently.

A Markdown page links to a lesson (``../examples/01_mean_of_means.py``) or to a
folder (``../examples/``, ``examples/flax_lm/``): on a code host the file or the
folder's README, on the site the lesson's gallery page or the README's page.
"""

from __future__ import annotations

import pathlib
import posixpath

import staging
from docutils import nodes
from sphinx import addnodes


def page_of(target: str, srcdir: pathlib.Path) -> str | None:
    """The page (docname) that stands for a repository file or folder on the site.

    >>> page_of("examples/01_mean_of_means.py", pathlib.Path("/nowhere"))
    'lessons/01_mean_of_means'
    >>> page_of("examples", pathlib.Path("/nowhere"))
    'lessons/index'
    """
    folder, name = posixpath.split(target)
    if folder == "examples" and name[:2].isdigit() and name.endswith(".py"):
        return f"{staging.LESSONS}/{name[:-3]}"
    if target == "examples":  # the lessons' folder: the gallery
        return f"{staging.LESSONS}/index"
    if (srcdir / target / "README.md").is_file():
        return f"{target}/README"
    return None


def lessons_and_folders(app, doctree: nodes.document) -> None:
    """``doctree-read``: a MyST link to a lesson or a folder goes to its page."""
    env = app.env
    here = posixpath.dirname(env.docname)
    for node in doctree.findall(addnodes.pending_xref):
        if node.get("reftype") != "myst" or node.get("refdomain"):
            continue
        path, _, anchor = node["reftarget"].partition("#")
        # the staged tree mirrors the repository: the path relative to it, as the code host reads it
        target = posixpath.normpath(posixpath.join(here, path))
        page = None if target.startswith("..") else page_of(target, pathlib.Path(app.srcdir))
        if page is not None:
            node["refdomain"], node["reftarget"] = "doc", page
            node["reftargetid"] = anchor or None
