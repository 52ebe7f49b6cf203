"""tinygpt's tests. Without torch (`make test-latest`), the torch twin's module is not
collected for its doctest; its tests skip with the reason (pytest.importorskip)."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("torch") else ["torch_gpt.py"]
