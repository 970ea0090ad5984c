"""Every module of the package can be the first one imported: an import cycle fails here.

Two modules that import each other at the top of the file work or fail depending on which one is
imported first, so each module is imported first once. One fresh interpreter imports them in turn
and forgets every linjax module before the next (JAX, flax and the other libraries stay loaded, so
this takes seconds where an interpreter per module would take minutes).
"""

import os
import subprocess
import sys

import tomllib

from tests.conftest import ROOT

IMPORT_EACH_FIRST = r"""
import importlib, sys, traceback
for name in sys.argv[1:]:
    for module in [m for m in sys.modules if m == "linjax" or m.startswith("linjax.")]:
        del sys.modules[module]
    try:
        importlib.import_module(name)
    except Exception:
        print(f"--- importing {name} first:\n{traceback.format_exc()}")
"""


def package_modules() -> list[str]:
    """Every module of the packages pyproject.toml installs, e.g. linjax.eval.approx."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    modules = []
    for package in setuptools["packages"]:
        folder = os.path.join(ROOT, setuptools["package-dir"][package])
        modules.append(package)
        modules += [f"{package}.{name[:-3]}" for name in sorted(os.listdir(folder))
                    if name.endswith(".py") and name != "__init__.py"]
    return modules


def test_every_module_imports_on_its_own(tmp_path):
    modules = package_modules()
    assert {"linjax.app.cli", "linjax.eval.approx", "linjax.convert.checkpoint", "linjax.kernels.gdn"} <= set(modules)
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH_FIRST, *modules], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "", done.stdout[-6000:]
