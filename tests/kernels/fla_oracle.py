"""Load FLA's naive PyTorch references as an independent oracle for the kernel tests.

`import fla` needs triton (absent on CPU machines), so the reference file
`fla/ops/<sub>/naive.py` is loaded on its own by file path. The naive files
only import torch (and einops). Tests that use this skip when fla-core or
torch is not installed, except in CI (the environment variable CI is set),
where a missing oracle fails them: a CI run must not pass by skipping them.
fla-core is pinned in .ci/run and the README's test command.
"""

from __future__ import annotations

import importlib.util
import os

from tests.helpers import missing


def fla_naive(sub: str):
    """The module `fla/ops/<sub>/naive.py` (e.g. sub="gla", "kda", "linear_attn"), or skip (fail in CI)."""
    for package in ("torch", "einops"):
        if importlib.util.find_spec(package) is None:
            missing(f"{package} is not installed (pip install -e '.[test]') - FLA oracle tests skipped")
    spec = importlib.util.find_spec("fla")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        missing("fla-core is not installed (pip install fla-core==0.6.0) - FLA oracle tests skipped")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", sub, "naive.py")
    if not os.path.exists(path):
        missing(f"this fla-core has no {path} (the tests expect fla-core==0.6.0)")
    module_spec = importlib.util.spec_from_file_location(f"fla_naive_{sub}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module
