"""The site's tests and doctests: conf.py is Sphinx's configuration, not a module to import,
and links.py needs Sphinx (the docs extra, `make docs`)."""

import importlib.util

collect_ignore = ["conf.py"]
if importlib.util.find_spec("sphinx") is None:
    collect_ignore.append("links.py")
