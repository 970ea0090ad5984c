"""Transparent huge pages for XLA's buffers on Linux (glibc), set before the process starts.

XLA:CPU allocates its large temporaries (activations, gradients, scan stacks) afresh at every
call. glibc serves allocations above 32 MiB with mmap, and the kernel faults the new pages in
4 KiB at a time: in a SmolLM2-135M training step at 512 tokens, zero-filling and first writes
of fresh buffers took about a quarter of the step. glibc's tunable `glibc.malloc.hugetlb=1`
(glibc 2.35 and later; older ones ignore it) makes malloc advise transparent huge pages, so
those buffers fault in 2 MiB at a time, which shortened the training step by about a sixth
(results/bench/HISTORY.md).

glibc reads tunables once, at process start, so the `linjax` command re-executes itself with
the tunable set (`reexec_module_with_huge_pages`); code that imports linjax can export
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 itself. LINJAX_HUGE_PAGES=0 turns this off.

The re-executed interpreter must import the same `linjax` as the first one. `python -c` would put
the working directory first on `sys.path`, and in a checkout of the repository that directory's
`linjax/` folder (which holds neither `kernels` nor `train`: the installed package maps them in)
would shadow the installed package; so the new process gets the first process's `sys.path[0]`
back, and its `-P` / `-I` / `-E` / `-s` flags.
"""

from __future__ import annotations

import os
import platform
import sys

from linjax import environment

TUNABLE = "glibc.malloc.hugetlb=1"


def environment_with_huge_pages(environ=None) -> dict | None:
    """A copy of `environ` with the tunable added, or None when it is set already or cannot apply."""
    environ = dict(os.environ if environ is None else environ)
    if not environment.flag("LINJAX_HUGE_PAGES", True, environ):
        return None
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current:
        return None
    environ["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
    return environ


def interpreter_flags() -> list[str]:
    """The flags of this interpreter that decide `sys.path`, to pass to a re-executed one."""
    flags = sys.flags
    if flags.isolated:
        return ["-I"]  # implies -E, -s and -P
    chosen = [flag for flag, on in (("-E", flags.ignore_environment), ("-s", flags.no_user_site)) if on]
    if getattr(flags, "safe_path", False):  # Python 3.11+: nothing is put in front of sys.path
        chosen.append("-P")
    return chosen


def reexec_module_with_huge_pages(module: str, argv: list[str]):
    """Replace this process by `module.main()` with `argv`, with the tunable set; return if not needed.

    The new interpreter starts with this one's flags and first `sys.path` entry (the console
    script's folder, or the directory `python -m` ran in), so it imports the same `linjax`."""
    first = None if (sys.flags.isolated or getattr(sys.flags, "safe_path", False)) else sys.path[0]
    code = (f"import sys; sys.path[0] = {os.path.abspath(first)!r}; " if first is not None else "") + \
        f"from {module} import main; main()"
    reexec_with_huge_pages([*interpreter_flags(), "-c", code, *argv])


def reexec_with_huge_pages(python_args: list[str]):
    """Replace this process by `python *python_args` with the tunable set; return if not needed.

    `python_args`: what follows the interpreter, e.g.
    ["-c", "from linjax.app.cli import main; main()", *sys.argv[1:]]."""
    environ = environment_with_huge_pages()
    if environ is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *python_args], environ)
