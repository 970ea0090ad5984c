"""The package's layers, read from the source with `ast`: a lower layer never imports a higher one.

    3  app         linjax.app.* (and the linjax.cli shim): the `linjax` command, `linjax run`,
                   argument types, huge pages, the watchdog thread
    2  tasks       linjax.convert, linjax.train, linjax.eval, linjax.fingerprint (may import
                   each other, except that eval never imports train: both read linjax.experiment)
    1  core        linjax.* (config, experiment, layers, mixers, model, generate, linearize,
                   files, heartbeat, ...)
    0  kernels     linjax.kernels: pure functions

Every `import` counts, at the top of a file or inside a function, so a lazy import that would
only fail at run time (or never, since nothing higher is missing) is still caught.
`test_imports.py` checks the other way a layering breaks: an import cycle.
The only upward imports allowed are listed in ALLOWED_UPWARD with the reason.
"""

from __future__ import annotations

import ast
import os

from tests.test_imports import ROOT, package_modules

APP = ("linjax.app", "linjax.cli")
# linjax.fingerprint lives in linjax/ but hashes checkpoints and training files through the converters
# and train.data, and only train, convert and the app use it: it is a task.
TASKS = ("linjax.convert", "linjax.train", "linjax.eval", "linjax.fingerprint")

# (importer, imported): upward imports that are part of the design.
ALLOWED_UPWARD = {
    # The public facade: `linjax.load` and `linjax.save_hf` read and write checkpoints through the
    # converters, imported inside those functions, so `import linjax` does not load them.
    ("linjax", "linjax.convert"), ("linjax", "linjax.convert.sources"),
    ("linjax", "linjax.convert.export"), ("linjax", "linjax.convert.hf"),
}


def layer(module: str) -> int:
    """0 kernels, 1 core, 2 convert/train/eval (and fingerprint), 3 the app."""
    if module == "linjax.kernels" or module.startswith("linjax.kernels."):
        return 0
    if any(module == top or module.startswith(top + ".") for top in APP):
        return 3
    if any(module == top or module.startswith(top + ".") for top in TASKS):
        return 2
    return 1


def source_path(module: str) -> str:
    """The file of a module of the installed packages (pyproject's package-dir layout)."""
    folders = {"linjax": "linjax", "linjax.app": "linjax/app", "linjax.mixers": "linjax/mixers",
               "linjax.kernels": "kernels", "linjax.convert": "convert", "linjax.train": "train", "linjax.eval": "eval"}
    if module in folders:
        return os.path.join(ROOT, folders[module], "__init__.py")
    package, name = module.rsplit(".", 1)
    return os.path.join(ROOT, folders[package], name + ".py")


def imported_modules(source: str, module: str, known: set[str]) -> list[tuple[str, int]]:
    """(linjax module, line) for every import in `source`, resolved to the known module it loads:
    `from linjax.kernels import gdn` is linjax.kernels.gdn, `from linjax.model import CausalLM`
    is linjax.model, relative imports resolved against `module`."""
    package = module if source_path(module).endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known:
                found.append((name, node.lineno))
    return found


# (importer, imported) packages of one layer that must not import each other: evaluation scores any
# model and reads experiment files through linjax.experiment, so it never needs training.
FORBIDDEN_SIDEWAYS = (("linjax.eval", "linjax.train"),)


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward_imports(module: str, source: str, known: set[str]) -> list[str]:
    """Each import in `source` of a higher layer than `module`'s, not in ALLOWED_UPWARD, and each
    import FORBIDDEN_SIDEWAYS."""
    problems = []
    for target, line in imported_modules(source, module, known):
        if layer(target) > layer(module) and (module, target) not in ALLOWED_UPWARD:
            problems.append(f"{module} (layer {layer(module)}) line {line} imports {target} (layer {layer(target)})")
        elif any(within(module, a) and within(target, b) for a, b in FORBIDDEN_SIDEWAYS):
            problems.append(f"{module} line {line} imports {target}: {module.split('.')[1]} never imports "
                            f"{target.split('.')[1]}")
    return problems


def test_no_layer_imports_a_higher_one():
    modules = package_modules()
    known = set(modules)
    assert {"linjax.app.cli", "linjax.app.watchdog", "linjax.kernels.softmax_blocked", "linjax.mixers.sinks_window",
            "linjax.eval.approx", "linjax.experiment", "linjax.heartbeat"} <= known
    problems = []
    for module in modules:
        with open(source_path(module), encoding="utf-8") as f:
            problems += upward_imports(module, f.read(), known)
    assert not problems, "\n".join(problems)


def test_the_check_catches_an_upward_import():
    """The check can fail: a kernel importing the model (even inside a function), the core importing
    training, evaluation importing the CLI or training, and the core importing the app are each
    reported; a downward import is not."""
    known = set(package_modules())
    lazy = "def f():\n    from linjax.model import CausalLM\n"
    assert upward_imports("linjax.kernels.gdn", lazy, known) == [
        "linjax.kernels.gdn (layer 0) line 2 imports linjax.model (layer 1)"]
    assert upward_imports("linjax.layers", "from linjax import train\n", known)
    assert upward_imports("linjax.eval.ruler", "import linjax.app.cli\n", known)
    assert upward_imports("linjax.generate", "from linjax.app import watchdog\n", known)
    assert upward_imports("linjax.mixers.gdn", "from ..kernels import gdn\nfrom ..train import loop\n", known) == [
        "linjax.mixers.gdn (layer 1) line 2 imports linjax.train.loop (layer 2)"]
    assert upward_imports("linjax.eval.models", "from linjax.train import load_experiment\n", known) == [
        "linjax.eval.models line 1 imports linjax.train: eval never imports train"]
    assert not upward_imports("linjax.eval.models", "from linjax.experiment import load_experiment\n", known)
    assert not upward_imports("linjax.app.cli", "from linjax.kernels import gdn\nimport linjax.model\n", known)
