"""Packaging: everything lives under `linjax`; nothing else is installed at the top level."""

import os
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT

SUBPACKAGES = ("kernels", "convert", "train", "eval")


def test_subpackages_import_from_their_folders():
    import importlib

    for name in SUBPACKAGES:
        module = importlib.import_module(f"linjax.{name}")
        assert os.path.dirname(module.__file__) == os.path.join(ROOT, name) or "site-packages" in module.__file__


def test_no_top_level_kernels_convert_train_eval(tmp_path):
    # A fresh interpreter outside the repository, so the checkout itself is not on sys.path.
    code = ("import importlib.util, linjax.kernels, linjax.convert, linjax.train, linjax.eval;"
            "print([n for n in %r if importlib.util.find_spec(n) is not None])" % (SUBPACKAGES,))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_wheel_holds_only_the_linjax_namespace(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "-q", "-w", str(tmp_path), ROOT], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"building the wheel failed:\n{result.stderr[-2000:]}")
    (wheel,) = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    top_level = {n.split("/")[0] for n in names}
    assert top_level == {"linjax", next(t for t in top_level if t.endswith(".dist-info"))}
    for name in SUBPACKAGES:
        assert f"linjax/{name}/__init__.py" in names
    assert "linjax/convert/gguf.py" in names and "linjax/mixers/softmax.py" in names
