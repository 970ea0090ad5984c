"""The watchdog: a stage that stops making progress ends with an error naming it, as a deadlock inside a compiled
program would otherwise hang the run without a word."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

from linjax.app import watchdog
from tests.helpers import python_environment


def test_progress_keeps_a_stage_alive_and_silence_stops_it():
    stalls = []
    on_stall = lambda stage, seconds, hint: stalls.append((stage, seconds))
    with watchdog.watch("busy", 0.5, on_stall=on_stall):
        for _ in range(15):  # 1.5 s in all, never 0.5 s without progress
            time.sleep(0.1)
            watchdog.progress()
    assert stalls == []
    with watchdog.watch("silent", 0.5, on_stall=on_stall):
        time.sleep(1.5)
    assert stalls == [("silent", 0.5)]


def test_a_stopped_and_resumed_process_is_not_a_stall(tmp_path):
    """A process stopped (SIGSTOP, Ctrl-Z, a scheduler's suspend) for longer than the limit, then
    resumed, goes on: the time it was stopped does not count. A silent stage still stops after."""
    code = """
        import sys, time
        from linjax.app import watchdog
        with watchdog.watch("busy", 1.0):
            print("ready", flush=True)
            for _ in range(40):  # 4 s, with progress every 0.1 s while running
                time.sleep(0.1)
                watchdog.progress()
        print("finished", flush=True)
        with watchdog.watch("silent", 1.0):
            time.sleep(30)
    """
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=python_environment())
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    process.send_signal(signal.SIGSTOP)
    time.sleep(3)  # three times the limit
    process.send_signal(signal.SIGCONT)
    out, err = process.communicate(timeout=60)
    assert "finished" in out, err[-2000:]
    assert process.returncode == watchdog.EXIT_STATUS and "silent made no progress for 1 s" in err, err[-2000:]


def test_off_when_seconds_is_zero_or_none():
    before = threading.active_count()
    for seconds in (0, None):
        with watchdog.watch("anything", seconds, on_stall=lambda *a: (_ for _ in ()).throw(AssertionError)):
            assert threading.active_count() == before


def _run_python(code: str, timeout: float = 120):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tempfile.gettempdir(),
                          capture_output=True, text=True, timeout=timeout, env=python_environment())


def test_a_stalled_linjax_run_stage_exits_with_its_name(tmp_path):
    """A `linjax run` stage stuck where no Python runs (here a long sleep) ends the process with exit
    status 3, the stage's name and every thread's stack; the stages before it stay recorded."""
    started = time.monotonic()
    done = _run_python(f"""
        import time
        from linjax.app import pipeline
        from linjax.experiment import from_dict

        pipeline._RUNNERS["convert"] = lambda config, run_dir: {{"stand-in": True}}
        pipeline._RUNNERS["train"] = lambda config, run_dir: time.sleep(300)   # hangs
        pipeline.run(from_dict({{"run_dir": {str(tmp_path)!r}}}), watchdog_seconds=2)
    """)
    assert time.monotonic() - started < 100
    assert done.returncode == watchdog.EXIT_STATUS, done.stderr[-3000:]
    assert "stage 'train' of linjax run made no progress for 2 s" in done.stderr
    assert "Most recent call first" in done.stderr or "File " in done.stderr  # the stacks
    assert os.path.exists(tmp_path / "stages" / "convert.json")
    assert not os.path.exists(tmp_path / "stages" / "train.json")


def test_cli_flag_reaches_eval_commands():
    from linjax.app.cli import build_parser

    args = build_parser().parse_args(["eval", "ruler", "m", "--out", "x.json", "--watchdog", "7"])
    assert (args.watched, args.watchdog) == ("linjax eval ruler", 7.0)
    args = build_parser().parse_args(["run", "c.toml"])
    assert args.watchdog == watchdog.DEFAULT_SECONDS and getattr(args, "watched", None) is None


def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on(tmp_path):
    """`kill -USR1` on a `linjax` process that seems stuck shows where it is, without stopping it."""
    code = """
        import os, signal, time
        from linjax.app import watchdog
        watchdog.dump_stacks_on_sigusr1()
        def waiting_in_a_named_function():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.2)
        waiting_in_a_named_function()
        print("went on", flush=True)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, capture_output=True,
                          text=True, env=python_environment(), timeout=60)
    assert done.returncode == 0 and "went on" in done.stdout, done.stderr[-2000:]
    assert "waiting_in_a_named_function" in done.stderr


def test_the_stack_dump_registers_while_stderr_is_captured(capsys):
    """`linjax.app.cli.main` called in-process (tests, notebooks) with sys.stderr replaced by an object that
    has no file descriptor still registers the handler, on the process's own stderr."""
    watchdog.dump_stacks_on_sigusr1()
