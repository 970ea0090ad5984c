"""Shared comparison helpers for the test-suite."""

import os

import numpy as np


def relative_rms(actual, expected) -> float:
    """‖actual − expected‖ / ‖expected‖ over all elements, computed in float64.

    The one error metric the tests use (ARCHITECTURE.md, "Testing conventions").
    An all-zero `expected` falls back to the absolute RMS of `actual`.
    """
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: {a.shape} vs {e.shape}")
    denom = np.linalg.norm(e)
    num = np.linalg.norm(a - e)
    return float(num / denom) if denom > 0 else float(num)


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
