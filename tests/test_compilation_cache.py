"""linjax/app/compilation_cache.py: the `linjax` command keeps compiled programs between calls, unless told not to."""

import os
import subprocess
import sys

from linjax.app import compilation_cache
from tests.helpers import python_environment


def test_the_folder_follows_linjax_cache_and_the_users_choice(monkeypatch, tmp_path):
    monkeypatch.setenv("LINJAX_CACHE", str(tmp_path))
    assert compilation_cache.folder({}) == os.path.join(str(tmp_path), "xla")
    assert compilation_cache.folder({"LINJAX_COMPILATION_CACHE": "0"}) is None
    assert compilation_cache.folder({"JAX_COMPILATION_CACHE_DIR": "/elsewhere"}) is None  # JAX reads it itself


def test_a_second_linjax_call_reads_the_programs_the_first_compiled(tiny_source, tmp_path):
    env = python_environment(LINJAX_CACHE=str(tmp_path / "cache"), LINJAX_HUGE_PAGES="0",
                             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's shared cache: the command must choose its own
    env.pop("LINJAX_COMPILATION_CACHE", None)
    command = [sys.executable, "-c", "import sys; from linjax.app.cli import main; sys.argv[0] = 'linjax'; main()",
               "generate", tiny_source, "--prompt", "The cat", "--max-new-tokens", "3"]
    folder = tmp_path / "cache" / "xla"

    first = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    compiled = sorted(p.name for p in folder.iterdir() if p.name.endswith("-cache"))
    assert any("forward" in name for name in compiled), compiled  # generate's prefill / decode program

    second = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert sorted(p.name for p in folder.iterdir() if p.name.endswith("-cache")) == compiled  # nothing compiled anew
