"""The FLA oracle is pinned and cannot be skipped in CI: the kernels' independent oracle must run."""

import importlib.metadata
import os
import re

import pytest

from tests.conftest import ROOT
from tests.kernels import fla_oracle


def test_ci_runs_the_readme_command_with_fla_core_pinned():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        command = next(line for line in f.read().splitlines() if '-e ".[test]"' in line)  # the README's test command
    with open(os.path.join(ROOT, "README.md")) as f:
        assert command in f.read().splitlines(), "README's test command and .ci/run differ"
    pinned = re.search(r"\bfla-core==([0-9][^\s&]*)", command)
    assert pinned, f"fla-core is not pinned in .ci/run: {command}"
    assert not re.search(r"\bfla-core(?!==)", command), "fla-core appears unpinned too"
    try:
        installed = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return
    assert installed == pinned.group(1), f"installed fla-core {installed}, CI pins {pinned.group(1)}"


def test_missing_oracle_skips_locally_and_fails_in_ci(monkeypatch):
    real = fla_oracle.importlib.util.find_spec
    monkeypatch.setattr(fla_oracle.importlib.util, "find_spec", lambda name: None if name == "fla" else real(name))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="fla-core is not installed"):
        fla_oracle.fla_naive("gla")
    monkeypatch.setenv("CI", "true")
    try:  # not pytest.raises(Failed): a skip must fail this test, not skip it
        fla_oracle.fla_naive("gla")
    except BaseException as err:  # pytest's outcomes derive from BaseException
        outcome = err
    else:
        outcome = None
    assert isinstance(outcome, pytest.fail.Exception), f"in CI a missing fla-core gave {outcome!r}, not a failure"
    assert "CI must run" in str(outcome)
