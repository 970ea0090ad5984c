"""linjax/app/hugepages.py: the `linjax` command starts with glibc's huge-page tunable, once, and keeps the user's."""

import os
import subprocess
import sys

import pytest

from linjax.app.hugepages import TUNABLE, environment_with_huge_pages

linux_glibc = pytest.mark.skipif(environment_with_huge_pages({}) is None, reason="needs Linux with glibc")


@linux_glibc
def test_tunable_added_once_and_existing_tunables_kept():
    assert environment_with_huge_pages({})["GLIBC_TUNABLES"] == TUNABLE
    assert environment_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == \
        f"glibc.malloc.arena_max=2:{TUNABLE}"
    assert environment_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None  # the user's choice
    assert environment_with_huge_pages({"LINJAX_HUGE_PAGES": "0"}) is None


@linux_glibc
def test_the_linjax_command_starts_again_with_the_tunable(monkeypatch):
    from linjax.app import cli

    class Replaced(Exception):
        pass

    def execve(path, args, environ):
        raise Replaced(path, args, environ)

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(sys, "argv", ["/usr/bin/linjax", "eval", "ruler", "--lengths", "1024"])
    with pytest.raises(Replaced) as replaced:
        cli.main()
    path, args, environ = replaced.value.args
    assert path == sys.executable and args[-4:] == ["eval", "ruler", "--lengths", "1024"]
    code = args[args.index("-c") + 1]
    # The new interpreter starts from this one's first sys.path entry, not the working directory.
    first_entry = os.path.abspath(sys.path[0])
    assert code == f"import sys; sys.path[0] = {first_entry!r}; from linjax.app.cli import main; main()"
    assert environ["GLIBC_TUNABLES"] == TUNABLE
    # Started again (the tunable is set), it runs the command instead of replacing itself once more.
    monkeypatch.setenv("GLIBC_TUNABLES", TUNABLE)
    with pytest.raises(SystemExit) as exited:
        cli.main()  # `--lengths 1024` without a model: argparse's usage error, status 2
    assert exited.value.code == 2


def test_a_subprocess_inherits_it():
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('GLIBC_TUNABLES', ''))"],
                         capture_output=True, text=True, timeout=60)
    # tests/conftest.py put it in this environment, so the suite's subprocesses run as the command does.
    assert (TUNABLE in out.stdout) == (environment_with_huge_pages({}) is not None)


def test_the_restarted_interpreter_keeps_the_path_flags(monkeypatch):
    from linjax.app import hugepages

    class Flags:
        isolated, ignore_environment, no_user_site, safe_path = 0, 1, 1, 1

    monkeypatch.setattr(sys, "flags", Flags)
    seen = []
    monkeypatch.setattr(hugepages, "reexec_with_huge_pages", seen.append)
    hugepages.reexec_module_with_huge_pages("linjax.app.cli", ["--help"])
    # -P: nothing goes in front of sys.path, so there is no first entry to restore.
    assert seen == [["-E", "-s", "-P", "-c", "from linjax.app.cli import main; main()", "--help"]]
