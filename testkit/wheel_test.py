"""The wheel installs jaxaccum, torch_ref and bigbatch, and they work without the repository.

The repository's own packages (tinygpt, testkit, parity_tests, benchmarks) stay in the
clone: a user's ``pip install`` must not drop a generic ``testkit`` into site-packages,
and nothing the wheel ships may import them.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

pytestmark = pytest.mark.slow  # builds and installs the wheel (about 20 s)

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHIPPED = {"jaxaccum", "torch_ref", "bigbatch"}


def test_the_wheel_holds_the_three_packages_and_they_stand_alone(tmp_path):
    source = tmp_path / "source"  # a copy: setuptools builds in the tree it is given
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in SHIPPED:
        shutil.copytree(ROOT / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)]
    built = subprocess.run(build, timeout=600, capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("jaxaccum-*.whl")
    names = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {n for n in names if not n.endswith(".dist-info")} == SHIPPED
    site = tmp_path / "site"
    install = [*pip, "install", "--no-deps", "--target", str(site), str(wheel)]
    installed = subprocess.run(install, timeout=300, capture_output=True, text=True)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    # -S: no site-packages processing, so neither the editable install nor the clone's .pth
    # file puts the repository on the path; the dependencies come from site-packages itself
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(site)!r}, {sysconfig.get_paths()["purelib"]!r}]
        import importlib.util
        import bigbatch, jaxaccum, jaxaccum.audit
        shipped = [bigbatch, jaxaccum]
        if importlib.util.find_spec("torch") is not None:  # the newest set has no torch
            import torch_ref, torch_ref.audit
            shipped.append(torch_ref)
        assert all(m.__file__.startswith({str(site)!r}) for m in shipped)
        for name in ("tinygpt", "testkit", "parity_tests", "benchmarks"):
            assert name not in sys.modules, name
            try:
                __import__(name)
            except ModuleNotFoundError:
                continue
            raise AssertionError(name + " is importable next to the wheel")
        print("ok")
    """)
    result = subprocess.run(
        [sys.executable, "-S", "-c", script], cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.stdout.strip() == "ok", result.stdout + result.stderr
