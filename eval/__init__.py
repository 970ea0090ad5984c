"""Evaluation: lm-eval bridge, approximation error, diagnostics, long context."""
