"""Every public name has a docstring, and every docstring example runs.

The API reference is built from the docstrings (``make docs``); a name without
one would be a bare signature there. ``pytest --doctest-modules`` runs the
``>>>`` examples of the modules it collects: here every example of a public name
is checked to be one of those, or to name the test that runs it.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import pathlib
import re
import sys

import public_api
import pytest
import staging

ROOT = staging.ROOT


def public_objects():
    """``(module, name, object)`` for every public name; without torch (the newest set),
    those of the modules that need it are left to the pinned set."""
    found = []
    for module_name in public_api.PUBLIC_MODULES:
        if module_name in public_api.NEEDS_TORCH and importlib.util.find_spec("torch") is None:
            continue
        module = importlib.import_module(module_name)
        found += [
            (module_name, n, getattr(module, n)) for n in public_api.public_names(module_name)
        ]
    return found


def is_routine_or_class(obj) -> bool:
    return inspect.isclass(obj) or inspect.isfunction(obj)


@pytest.mark.parametrize("module_name", public_api.PUBLIC_MODULES)
def test_public_modules_say_what_is_public(module_name):
    if module_name in public_api.NEEDS_TORCH:
        pytest.importorskip("torch", reason=f"{module_name} needs torch")
    module = importlib.import_module(module_name)
    assert isinstance(getattr(module, "__all__", None), list), f"{module_name}: no __all__"
    assert (module.__doc__ or "").strip(), f"{module_name}: no module docstring"


def test_every_public_name_has_a_docstring():
    missing = []
    for module_name, name, obj in public_objects():
        if is_routine_or_class(obj):
            own = obj.__doc__ if not inspect.isclass(obj) or "__doc__" in vars(obj) else None
            doc = inspect.cleandoc(own or "")
        else:  # a constant: the string after its assignment
            doc = (public_api.constant_doc(module_name, name) or "").strip()
        if not doc or not doc.split("\n")[0].strip():
            missing.append(f"{module_name}.{name}")
    assert not missing, "public names without a docstring (a one-line summary first):\n" + (
        "\n".join(missing)
    )


def collected_by_doctest_modules(config, path) -> bool:
    """Whether ``pytest --doctest-modules`` collects the module at ``path``: under a test
    path and not ignored (the root conftest's ``collect_ignore_glob``)."""
    relative = path.relative_to(ROOT).as_posix()
    under_test_path = any(relative.startswith(f"{p}/") for p in config.getini("testpaths"))
    ignored = config.hook.pytest_ignore_collect(collection_path=path, config=config)
    return under_test_path and not ignored


def test_docstring_examples_run(request):
    """A ``>>>`` example is a doctest that pytest collects; any other example names the
    test file that runs it, which exists."""
    wrong = []
    for module_name, name, obj in public_objects():
        if not is_routine_or_class(obj) or not obj.__doc__:
            continue
        where = f"{module_name}.{name}"
        if ">>>" in obj.__doc__:
            module = sys.modules[obj.__module__]
            tests = doctest.DocTestFinder().find(module, module.__name__)
            names = {t.name for t in tests if t.examples}
            if f"{module.__name__}.{obj.__qualname__}" not in names:
                wrong.append(f"{where}: its doctest is not found in {module.__name__}")
            elif not collected_by_doctest_modules(request.config, pathlib.Path(module.__file__)):
                wrong.append(
                    f"{where}: pytest --doctest-modules does not collect {module.__name__}"
                )
        elif re.search(r"^\s*Examples?\b", obj.__doc__, re.M):
            ran_by = re.search(r"Examples? \(``([\w/]+_test\.py)`` runs it", obj.__doc__)
            if ran_by is None or not (ROOT / ran_by[1]).is_file():
                wrong.append(f"{where}: an example that is no doctest and names no test")
    assert not wrong, "\n".join(wrong)


def test_every_lesson_reads_as_a_gallery_example():
    for path in staging.LESSON_PATHS:
        lesson = staging.lesson_for_gallery(path.read_text(), f"examples/{path.name}")
        title = lesson.split("\n", 1)[0].strip('"')
        assert lesson.split("\n")[1] == "=" * len(title), path.name
        compile(lesson, path.name, "exec")  # what sphinx-gallery runs is Python
