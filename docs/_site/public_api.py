"""The public names the API reference documents, their public paths, and its pages.

A public module's public names are its ``__all__``. A name defined in a private
module (``jaxaccum._multi_steps.multi_steps``) is documented, and linked, under
its public path (``jaxaccum.multi_steps``), so splitting a private module changes
nothing on the site.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect

# The public modules, in the API reference's order.
PUBLIC_MODULES = ["jaxaccum", "jaxaccum.losses", "jaxaccum.audit", "torch_ref.audit", "bigbatch"]
# Modules that import torch (absent from the newest set: ``make test-latest``).
NEEDS_TORCH = {"torch_ref.audit"}


def public_names(module_name: str) -> list[str]:
    """The names of ``__all__`` of a public module, submodules left out.

    >>> public_names("jaxaccum.audit")
    ['BIG_BATCH_RTOL', 'AuditReport', 'BigBatchCheck', 'InvarianceReport', 'audit_invariance', 'audit_window', 'check_big_batch']
    """
    module = importlib.import_module(module_name)
    return [n for n in module.__all__ if not inspect.ismodule(getattr(module, n))]


@functools.cache
def public_paths() -> dict[int, str]:
    """``id(object)`` -> its public path, for the classes and functions of the public modules.

    An object exported by several public modules has the path of its own package
    (``bigbatch.AuditReport``, also exported by both audits), else the first one.
    """
    paths: dict[int, str] = {}
    for module_name in PUBLIC_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # torch_ref without torch
            continue
        for name in public_names(module_name):
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                own_package = module_name == obj.__module__.split(".")[0]
                if id(obj) not in paths or own_package:
                    paths[id(obj)] = f"{module_name}.{name}"
    return paths


def page(module_name: str) -> str:
    """The API reference page of a public module: its docstring, a table of its public
    names, then each one from its docstring, in ``__all__``'s order.

    A name exported by several public modules is documented at its public path
    (:func:`public_paths`) and named here as the same object; a constant
    gets ``autodata`` (autodoc's ``:members:`` skips constants that a module imports).

    >>> print(page("jaxaccum.audit"))
    jaxaccum.audit
    ==============
    <BLANKLINE>
    .. automodule:: jaxaccum.audit
       :no-members:
    <BLANKLINE>
    .. autosummary::
    <BLANKLINE>
       BIG_BATCH_RTOL
       AuditReport
       BigBatchCheck
       InvarianceReport
       audit_invariance
       audit_window
       check_big_batch
    <BLANKLINE>
    ...
    .. py:class:: AuditReport
    <BLANKLINE>
       The same class as :py:class:`bigbatch.AuditReport`.
    ...
    .. autofunction:: check_big_batch
    <BLANKLINE>
    """
    module = importlib.import_module(module_name)
    names = public_names(module_name)
    lines = [module_name, "=" * len(module_name), "", f".. automodule:: {module_name}",
             "   :no-members:", "", ".. autosummary::", ""]  # fmt: skip
    lines += [f"   {name}" for name in names] + [""]
    for name in names:
        obj = getattr(module, name)
        home = public_paths().get(id(obj), f"{module_name}.{name}")
        if home != f"{module_name}.{name}":
            kind, role = ("class", "class") if inspect.isclass(obj) else ("function", "func")
            lines += [
                f".. py:{kind}:: {name}",
                "",
                f"   The same {kind} as :py:{role}:`{home}`.",
                "",
            ]
        elif inspect.isclass(obj):
            lines += [f".. autoclass:: {name}", ""]
        elif inspect.isfunction(obj):
            lines += [f".. autofunction:: {name}", ""]
        else:  # a long value (a dict of sentences) is left to the docstring
            lines += [f".. autodata:: {name}"] + ["   :no-value:"] * (len(repr(obj)) > 60) + [""]
    return "\n".join(lines)


def _assignments(source: str) -> tuple[dict[str, str | None], dict[str, str]]:
    """A module's constants (name -> the string literal after the assignment, or None) and
    its imported names (name -> the module imported from)."""
    tree = ast.parse(source)
    constants: dict[str, str | None] = {}
    imported: dict[str, str] = {}
    for node, after in zip(tree.body, [*tree.body[1:], None], strict=True):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.update({alias.asname or alias.name: node.module for alias in node.names})
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            literal = after.value if isinstance(after, ast.Expr) else None
            is_doc = isinstance(literal, ast.Constant) and isinstance(literal.value, str)
            constants.update({t.id: literal.value if is_doc else None for t in targets})
    return constants, imported


def constant_doc(module_name: str, name: str) -> str | None:
    """The docstring of a public module's constant: the string literal after its assignment,
    in the module that assigns it (``bigbatch.FORM_NAMES``: ``bigbatch._forms``).

    >>> constant_doc("bigbatch", "IGNORE_INDEX").split(":")[0]
    'The label of a position that carries no loss (prompt, padding)'
    """
    for _ in range(10):  # a chain of re-exports
        source = inspect.getsource(importlib.import_module(module_name))
        constants, imported = _assignments(source)
        if name in constants:
            return constants[name]
        if name not in imported:
            return None
        module_name = imported[name]
    return None


# --- autodoc's events ---------------------------------------------------------------------


def constant_docstring(app, what, name, obj, options, lines) -> None:
    """``autodoc-process-docstring``: a constant's docstring is the string after its
    assignment, in the module that assigns it (autodoc reads only the documented module's
    source, and autosummary falls back to the docstring of the value's type)."""
    module_name, _, attribute = name.rpartition(".")
    doc = constant_doc(module_name, attribute) if what == "data" else None
    if doc is not None:
        lines[:] = inspect.cleandoc(doc).splitlines()


def google_style_except_sentences(app) -> None:
    """napoleon reads Google style in every docstring but those of constants, attributes
    and properties: here they are sentences, and napoleon would read their first line's
    ``text: text`` as Google style's ``type: description``."""
    from sphinx.ext import napoleon

    for listener in list(app.events.listeners["autodoc-process-docstring"]):
        if listener.handler is napoleon._process_docstring:
            app.disconnect(listener.id)

    def google_style(app, what, name, obj, options, lines):
        if what not in ("data", "attribute", "property"):
            napoleon._process_docstring(app, what, name, obj, options, lines)

    app.connect("autodoc-process-docstring", google_style)


def skip_tuple_fields(app, what, name, obj, skip, options):
    """``autodoc-skip-member``: a NamedTuple's fields are documented by its Attributes."""
    if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None
