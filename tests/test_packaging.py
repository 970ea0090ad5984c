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
    """linjax installs none of the four names at the top level; other projects may (transformers 5.25
    and later depends on Hugging Face's `kernels`), so a name found must belong to another distribution."""
    # A fresh interpreter outside the repository, so the checkout itself is not on sys.path.
    code = ("import importlib.metadata, importlib.util, linjax.kernels, linjax.convert, linjax.train, linjax.eval;"
            "owners = importlib.metadata.packages_distributions();"
            f"print([n for n in {SUBPACKAGES!r} if importlib.util.find_spec(n) is not None"
            " and 'linjax' in owners.get(n, ['linjax'])])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_checkout_kernels_folder_hands_its_name_to_the_installed_package():
    """From the checkout's root, `kernels` is first this folder; imported under that name it gives the
    name to Hugging Face's package where one is installed, so transformers loads (it imports
    `kernels` at load from 5.25 on) and linjax.kernels stays linjax's."""
    code = ("import importlib.metadata, os, kernels, linjax.kernels.gla as gla;"
            "from transformers import LlamaConfig; LlamaConfig();"
            "owners = importlib.metadata.packages_distributions().get('kernels', []);"
            "print(bool([o for o in owners if o != 'linjax']), os.path.realpath(kernels.__file__),"
            " os.path.realpath(gla.__file__))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT,  # checkout root on purpose: shadowing
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    installed, top_level, ours = done.stdout.split()
    checkout = os.path.realpath(os.path.join(ROOT, "kernels", "__init__.py"))
    assert (top_level != checkout) if installed == "True" else (top_level == checkout)
    assert ours.endswith(os.path.join("kernels", "gla.py"))  # linjax's GLA, under either name of its folder


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
    assert "linjax/app/cli.py" in names and "linjax/kernels/softmax_blocked.py" in names
    entry_points = zipfile.ZipFile(tmp_path / wheel).read(next(n for n in names if n.endswith("entry_points.txt")))
    assert b"linjax = linjax.app.cli:main" in entry_points


def test_the_old_command_module_still_runs_the_command(tmp_path):
    """`linjax.cli:main` (the console script of installs made before the CLI moved to linjax/app/)
    and `python -m linjax.cli` run the same command."""
    import linjax.app.cli
    import linjax.cli

    assert linjax.cli.main is linjax.app.cli.main
    done = subprocess.run([sys.executable, "-m", "linjax.cli", "--version"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("linjax "), done.stderr[-2000:]


def _fresh_environment_with(wheel_dir, root) -> str:
    """A new virtualenv holding only the wheel, non-editable; the test environment's packages after it.

    The test environment's site-packages are added as plain path lines, so its `.pth` files (the
    editable install's finder among them) do not run: `linjax` can come only from the wheel."""
    import site
    import sysconfig

    venv = os.path.join(root, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = os.path.join(venv, "bin", "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if p and os.path.isdir(p) and "site-packages" in p and p != purelib]
    with open(os.path.join(purelib, "test-environment.pth"), "w") as f:
        f.write("\n".join(dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], *ours])) + "\n")
    (wheel,) = [os.path.join(wheel_dir, p) for p in os.listdir(wheel_dir) if p.endswith(".whl")]
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index",
                    wheel], check=True, capture_output=True, timeout=300)
    return venv


def test_installed_command_runs_from_the_checkout_root(tmp_path):
    """The README's first command: a non-editable install, `linjax` run in the repository root.

    The command re-executes itself for huge pages; the new interpreter must import the installed
    `linjax`, not the checkout's `linjax/` folder (which lacks the mapped-in subpackages)."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "wheel"), ROOT], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    venv = _fresh_environment_with(tmp_path / "wheel", tmp_path)
    installed = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                                "import os, linjax; print(os.path.dirname(linjax.__file__))"], cwd=tmp_path,
                               capture_output=True, text=True, check=True).stdout.strip()
    assert installed.startswith(str(tmp_path)), installed
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LINJAX_HUGE_PAGES", "PYTHONPATH")}
    command = os.path.join(venv, "bin", "linjax")
    for args in (["run", "--help"], ["train", "--help"], ["--version"]):
        done = subprocess.run([command, *args], env=env, capture_output=True, text=True, timeout=300,
                              cwd=ROOT)  # checkout root on purpose: the README runs it there
        assert done.returncode == 0, f"linjax {' '.join(args)}:\n{done.stderr[-3000:]}"
    version = subprocess.run([command, "--version"], cwd=ROOT, env=env,  # checkout root on purpose: as above
                             capture_output=True, text=True, timeout=300)
    assert version.stdout.strip().endswith(f"from {installed}"), version.stdout


def test_ci_runs_the_readme_first_command_with_the_smoke_config():
    """.ci/run starts with the README's first command, the demo config swapped for the seconds-long one."""
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [line for line in f.read().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read().splitlines()
    (first,) = [line for line in readme if line.endswith("linjax run configs/demo.toml")]
    assert first.startswith("python3 -m venv .venv") and " -e " not in first  # a non-editable install
    assert first.replace("configs/demo.toml", "configs/smoke.toml") in ci
    assert os.path.exists(os.path.join(ROOT, "configs", "smoke.toml"))
