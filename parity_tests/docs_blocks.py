"""Blocks of a document that code writes: ``<!-- NAME: begin (how) -->`` ... ``<!-- NAME: end -->``.

The docs' number check leaves such a block to its generator's test, which checks that
the block is what the code produces (``examples/docs_numbers_test.py``, rule 7).
"""

from __future__ import annotations

import re


def begin(name: str, how: str) -> str:
    """The opening marker of block ``name``, saying how it is written."""
    return f"<!-- {name}: begin ({how}) -->"


def end(name: str) -> str:
    return f"<!-- {name}: end -->"


def block(document: str, name: str) -> str:
    """Block ``name`` of ``document``, its markers included.

    Example:
      >>> block("a\\n<!-- t: begin (by hand) -->\\nx\\n<!-- t: end -->\\nb", "t")
      '<!-- t: begin (by hand) -->\\nx\\n<!-- t: end -->'
    """
    found = re.search(rf"<!-- {re.escape(name)}: begin .*?{re.escape(end(name))}", document, re.S)
    if found is None:
        raise ValueError(f"document: expected the markers of the block {name!r}: {end(name)!r}")
    return found[0]


def replace_block(document: str, name: str, content: str) -> str:
    """``document`` with block ``name`` replaced by ``content`` (markers included)."""
    return document.replace(block(document, name), content, 1)
