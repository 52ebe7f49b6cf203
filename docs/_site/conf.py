"""Sphinx configuration of the documentation site: ``make docs`` -> ``out/docs/index.html``.

``sphinx-build -c docs/_site out/docs-src out/docs``: the source tree
``out/docs-src`` is assembled from the repository when the configuration is
read (``staging.py``), the lessons run as sphinx-gallery examples (their
assertions fail the build), the API reference comes from the docstrings.
"""

from __future__ import annotations

import os
import pathlib
import sys

SITE = pathlib.Path(__file__).resolve().parent
ROOT = SITE.parents[1]
# the lessons import their sibling _common; conf.py its siblings
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(SITE)]

# The lessons run in this process, one after the other: JAX on the CPU with the 8 fake
# devices of the test suite (lessons 3 and 8 need 4), set before any JAX operation.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# A progress bar is for a terminal; on a lesson's page it would be lines of timings.
os.environ.setdefault("TQDM_DISABLE", "1")

import _headlines  # noqa: E402
import links  # noqa: E402
import public_api  # noqa: E402
import staging  # noqa: E402

project = "jaxaccum"
author = "the jaxaccum authors"
copyright = "the jaxaccum authors"  # Sphinx's name for it
release = version = "0.2.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",  # the table of names at the top of each API page
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # MathJax 3 copied into _static: the site typesets offline
    "sphinx_gallery.gen_gallery",
]
root_doc = "index"
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = [f"{staging.LESSONS_SOURCE}/**", "**/sg_execution_times.rst"]
nitpicky = True  # make docs runs with -n too: every cross-reference resolves
# Other projects' names in the type hints: no inventory of theirs can be fetched offline,
# so they stay plain text.
nitpick_ignore_regex = [(r"py:class", r"(jax|numpy|optax|torch|collections\.abc)\..*")]

# Markdown: the pages as a code host shows them; ```math blocks are typeset.
myst_enable_extensions = ["dollarmath"]  # $...$, as the code host reads it
myst_fence_as_directive = ["math"]
myst_heading_anchors = 3  # the code host's anchors: [](math.md#2-the-mean-of-means)

# API reference: autodoc + napoleon (Google style), signatures with their type hints.
autodoc_default_options = {"members": True, "member-order": "bysource"}
autosummary_generate = False  # the API pages are public_api.page's
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autoclass_content = "class"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # NamedTuple fields: documented once, by their class's Attributes
napoleon_attr_annotations = False  # their dtypes and shapes are in their descriptions

html_theme = "furo"
html_title = "jaxaccum"
html_copy_source = False
html_show_sourcelink = False

sphinx_gallery_conf = {
    "examples_dirs": staging.LESSONS_SOURCE,
    "gallery_dirs": staging.LESSONS,
    # run every lesson this environment can (staging shows the others' recorded output)
    "filename_pattern": "/({})_".format(
        "|".join(p.name[:2] for p in staging.LESSON_PATHS if _headlines.runnable(p.name[:2]))
    ),
    "run_stale_examples": True,  # every build: the library may have changed under a lesson
    "within_subsection_order": "FileNameSortKey",
    "download_all_examples": False,
    "remove_config_comments": True,
    "capture_repr": (),
    "write_computation_times": False,
    "min_reported_time": 3600,  # run times vary with the machine: not printed
}


def setup(app):
    app.connect("config-inited", lambda app, config: staging.stage(app.srcdir))
    app.connect("doctree-read", links.lessons_and_folders)
    app.connect("autodoc-skip-member", public_api.skip_tuple_fields)
    app.connect("autodoc-process-docstring", public_api.constant_docstring)
    public_api.google_style_except_sentences(app)
