"""Loading an experiment script as a fresh module."""

from __future__ import annotations

import importlib.util
import os

EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def experiment_script(filename: str, register=None):
    """A fresh module of `experiments/<filename>` (each test gets its own, so a monkeypatched constant does
    not leak into the next). `register`: called with (name, module) before the module runs, for one whose
    dataclasses look it up in sys.modules."""
    name = os.path.splitext(filename)[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXPERIMENTS, filename))
    module = importlib.util.module_from_spec(spec)
    if register is not None:
        register(name, module)
    spec.loader.exec_module(module)
    return module
