"""tinygpt's tests. Without torch (`make test-latest`), the torch twin's modules are not
collected for their doctests; its tests skip with the reason (pytest.importorskip)."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("torch") else ["torch_gpt.py", "torch_testing.py"]
