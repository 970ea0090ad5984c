"""Shared comparison helpers for the test-suite."""

import os

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


def linear_mechanisms() -> tuple[str, ...]:
    """Every linear mechanism of the mixer registry (`linjax.linearize.MIXERS`, the LinearMixer
    subclasses), so a new mechanism joins the decode and export grids without an edit here."""
    from linjax.linearize import MIXERS
    from linjax.mixers.linear import LinearMixer

    return tuple(name for name, mixer in MIXERS.items() if issubclass(mixer, LinearMixer))


def window_mechanisms() -> tuple[str, ...]:
    """Every mechanism of the mixer registry that attends through sinks + window (all but softmax)."""
    from linjax.linearize import MIXERS
    from linjax.mixers.softmax import SoftmaxAttention

    return tuple(name for name, mixer in MIXERS.items() if mixer is not SoftmaxAttention)
