"""Shared comparison helpers for the test-suite."""

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
