"""Runs, locks, inputs and crashes: a finished run is never retrained or rewritten by
accident, one writer at a time per output, a run's inputs are fingerprinted and checked, and a kill or a
signal at any point leaves what the next command recovers."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

import linjax
from linjax import heartbeat, train
from linjax.app import pipeline, watchdog
from linjax.files import WriterBusy, lock_path, writer_lock
from linjax.layers import Trainable
from tests.conftest import ROOT
from tests.helpers import python_environment
from tests.test_reliability import leftovers, one_line_error, run_cli, snapshot
from tests.test_train import _write_toml, corpus, experiment  # noqa: F401 (corpus is a fixture)


def everything(directory) -> dict:
    """{relative path: sha256 of a file, or "dir"}: what `snapshot` sees, plus (empty) folders."""
    found = dict(snapshot(directory))
    for root, dirs, _ in os.walk(directory):
        found.update({os.path.relpath(os.path.join(root, d), directory): "dir" for d in dirs})
    return found


def trainable_leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, Trainable))]


def assert_same_parameters(a, b):
    a, b = trainable_leaves(a), trainable_leaves(b)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


def python(code: str, *args, cwd=None, timeout=600):
    """A Python subprocess running `code` (dedented) with the installed linjax and `tests` importable,
    the working directory (`cwd`, else the system's temporary folder) kept off sys.path."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          cwd=cwd or tempfile.gettempdir(), capture_output=True, text=True, timeout=timeout,
                          env=python_environment())


# ----------------------------------------------------------------------------- 1. a finished run stays as it is


def test_a_finished_run_is_never_retrained_by_a_documented_command(tiny_source, corpus, tmp_path, capsys):
    run = tmp_path / "run"
    config_path = tmp_path / "run.toml"
    _write_toml(config_path, experiment(run, tiny_source, corpus, steps=2, warmup_steps=0, checkpoint_every=1))
    train_cli = ["train", config_path, "--no-progress"]
    assert run_cli(train_cli, capsys)[0] == 0
    # Extending a finished run goes on from its last checkpoint.
    status, _, err = run_cli(train_cli + ["--resume", "--set", "train.steps=3"], capsys)
    assert status == 0, err
    assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [1, 2, 3]
    assert json.loads((run / "linjax.json").read_text())["steps"] == 3

    shutil.rmtree(run / "checkpoints")  # as the committed claims rows keep their runs
    before, beside = everything(run), sorted(os.listdir(tmp_path))
    status, _, err = run_cli(train_cli + ["--set", "train.steps=3"], capsys)  # a fresh start: refused
    line = one_line_error(err)
    assert status == 2 and str(run) in line and "finished run (3 steps)" in line and "--resume" in line
    status, out, err = run_cli(train_cli + ["--resume", "--set", "train.steps=3"], capsys)  # nothing to do
    assert status == 0, err
    assert f"{run} is finished (3 steps); nothing to do" in out
    status, _, err = run_cli(train_cli + ["--resume", "--set", "train.steps=4"], capsys)  # no checkpoint left
    line = one_line_error(err)
    assert status == 2 and "no checkpoint to continue from" in line and "new run_dir" in line
    assert everything(run) == before and sorted(os.listdir(tmp_path)) == beside


@pytest.mark.parametrize("history", ["config.json", "metrics.jsonl", "trainable/x", "checkpoints/2/x"])
def test_a_fresh_start_where_a_run_left_anything_is_refused(history, corpus, tmp_path, capsys):
    run = tmp_path / "run"
    (run / history).parent.mkdir(parents=True, exist_ok=True)
    (run / history).write_text('{"step": 1, "loss": 3.0}\n')
    config_path = tmp_path / "run.toml"
    _write_toml(config_path, experiment(run, str(tmp_path / "no-model-needed"), corpus))
    before = everything(run)
    status, _, err = run_cli(["train", config_path, "--no-progress"], capsys)
    line = one_line_error(err)
    assert status == 2 and f"{run} already holds a run ({history.split('/')[0]})" in line and "--resume" in line
    assert everything(run) == before


CLAIMS = sorted(glob.glob(os.path.join(ROOT, "configs", "claims", "*.toml")))


def _trained_row(path) -> bool:
    """Whether the claims config's run directory holds a trained run (not a training-free baseline)."""
    return os.path.isfile(os.path.join(ROOT, train.load_experiment(path).run_dir, "linjax.json"))


@pytest.mark.parametrize("path", [p for p in CLAIMS if _trained_row(p)], ids=os.path.basename)
def test_the_claims_rows_are_finished_runs_their_resume_command_leaves_alone(path):
    """Each committed claims row is a finished run of its config as `--resume` reads it (same settings,
    as many steps as asked, no checkpoint): the command its config documents changes nothing (the
    behaviour itself: the test below and the first of this file)."""
    from linjax.train.loop import _refuse_other_settings, _stored_record, finished_steps

    config = train.load_experiment(path)
    run_dir = os.path.join(ROOT, config.run_dir)
    assert finished_steps(run_dir) == config.train.steps
    _refuse_other_settings(_stored_record(run_dir), config.to_dict(), run_dir)


def test_the_documented_resume_of_a_claims_row_changes_nothing(tmp_path):
    """`linjax train configs/claims/gdn.toml --resume`, on a copy of its committed row, from the
    repository root as documented: exit 0, "finished", every byte the same."""
    row = os.path.join(ROOT, "results", "runs", "gdn")
    assert os.path.isdir(row), "results/runs/gdn, a committed claims row, is missing"
    copy = tmp_path / "gdn"
    shutil.copytree(row, copy)
    before = everything(copy)
    done = python("from linjax.app.cli import main; import sys; main(sys.argv[1:])", "train",
                  os.path.join(ROOT, "configs", "claims", "gdn.toml"), "--resume", "--no-progress",
                  "--set", f"run_dir={json.dumps(str(copy))}", cwd=ROOT)  # checkout root on purpose: as documented
    assert done.returncode == 0, done.stderr[-2000:]
    assert "is finished (2000 steps); nothing to do" in done.stdout
    assert everything(copy) == before and sorted(os.listdir(tmp_path)) == ["gdn"]


# ----------------------------------------------------------------------------- 2. one writer at a time

HOLD_LOCKS = """
import sys, time
from contextlib import ExitStack
from linjax.files import writer_lock
with ExitStack() as stack:
    for target in sys.argv[1:]:
        stack.enter_context(writer_lock(target))
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """hold(*targets): another process holding the writer locks of `targets`; its pid."""
    processes = []

    def hold(*targets):
        process = subprocess.Popen([sys.executable, "-c", HOLD_LOCKS, *map(str, targets)], cwd=tmp_path, text=True,
                                   stdout=subprocess.PIPE, env=python_environment())
        processes.append(process)
        assert process.stdout.readline().strip() == "held"
        return process.pid

    yield hold
    for process in processes:
        process.kill()
        process.wait()


def test_a_second_writer_stops_with_one_line_naming_the_first(tiny_source, corpus, tmp_path, holder, capsys):
    run, export, evaluation = tmp_path / "run", tmp_path / "export", tmp_path / "lm_eval"
    config_path = tmp_path / "run.toml"
    _write_toml(config_path, experiment(run, tiny_source, corpus, steps=1, warmup_steps=0))
    pid = holder(run, export, evaluation)
    for argv in (["train", config_path, "--no-progress"], ["run", config_path],
                 ["export", tiny_source, "--out", export], ["convert", tiny_source, "--out", export],
                 ["linearize", tiny_source, "--out", export]):
        status, _, err = run_cli(argv, capsys)
        line = one_line_error(err)
        assert status == 2 and f"pid {pid}" in line and "another process" in line, argv
    assert not run.exists() or os.listdir(run) == []
    assert not export.exists()
    from linjax.eval import lm_eval_bridge

    with pytest.raises(WriterBusy, match=f"lm-eval output folder .*pid {pid}"):
        lm_eval_bridge.run(tiny_source, tasks=["piqa"], out_dir=str(evaluation))


def test_the_writer_lock_is_reentrant_released_and_removed(tmp_path):
    target = tmp_path / "out"
    with writer_lock(target):
        with writer_lock(target):  # e.g. `linjax run`'s training stage inside the run's lock
            assert os.path.exists(lock_path(target))
        assert open(lock_path(target)).read().strip() == str(os.getpid())
    assert not os.path.exists(lock_path(target))
    with writer_lock(target):  # released: it can be taken again
        pass
    assert os.listdir(tmp_path) == []


def test_a_waiting_writer_goes_on_once_the_holder_is_gone(tmp_path, holder):
    """The GGUF cache's lock waits (two processes loading one GGUF convert it once); a killed holder's
    lock is released by the kernel, its stale file notwithstanding."""
    import threading

    target = tmp_path / "gguf-cache"
    pid = holder(target)
    with pytest.raises(WriterBusy), writer_lock(target):
        pass
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    with writer_lock(target, wait=True):
        assert open(lock_path(target)).read().strip() == str(os.getpid())


# ----------------------------------------------------------------------------- 3. fingerprinted inputs


def test_changed_inputs_are_refused_by_resume_load_and_run_unless_allowed(tiny_source, corpus, tmp_path, monkeypatch):
    base = tmp_path / "base"
    shutil.copytree(tiny_source, base)
    run = tmp_path / "run"
    config = experiment(run, str(base), corpus, steps=2, warmup_steps=0, checkpoint_every=1)
    trained = train.run(config, progress=False)
    inputs = json.loads((run / "config.json").read_text())["inputs"]
    assert inputs["data"]["files"][0]["path"] == corpus and inputs["model"]["tokenizer"]
    longer = experiment(run, str(base), corpus, steps=3, warmup_steps=0, checkpoint_every=1)

    # The data: an edited file.
    original = open(corpus).read()
    with open(corpus, "a") as f:
        f.write('\n{"text": "one more document"}')
    with pytest.raises(ValueError, match=r"inputs changed since the run recorded them: the training data \(1 → 1 "
                                         rf"files; differing: {corpus}\)") as refused:
        train.run(longer, resume=True, progress=False)
    assert "--allow-changed-inputs" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="the training data"):
        pipeline.run(longer, watchdog_seconds=None)
    open(corpus, "w").write(original)

    # The tokenizer and the base model's weights: `linjax.load(run)` names what changed.
    tokenizer_config = base / "tokenizer_config.json"
    tokenizer_config.write_text(tokenizer_config.read_text().replace("{", '{"edited": true,', 1))
    with pytest.raises(ValueError, match=r"the tokenizer files \(") as refused:
        linjax.load(str(run))
    assert "base model's weights" not in str(refused.value)
    from linjax.config import tiny_config
    from linjax.model import CausalLM

    _, tokenizer = linjax.load(tiny_source)
    other = CausalLM(tiny_config("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id),
                     rngs=nnx.Rngs(7))  # the same architecture, other weights: loads silently without the check
    shutil.rmtree(base)
    linjax.save_hf(other, str(base), tokenizer)
    with pytest.raises(ValueError, match=r"the base model's weights \("):
        linjax.load(str(run))
    second_stage = experiment(tmp_path / "second", str(base), corpus, steps=1, warmup_steps=0, init_from=str(run))
    with pytest.raises(ValueError, match=r"starting from its parameters .*base model's weights|"
                                         r"base model's weights .*starting from its parameters"):
        train.run(second_stage, progress=False)
    monkeypatch.setenv("LINJAX_ALLOW_CHANGED_INPUTS", "1")
    linjax.load(str(run))
    monkeypatch.delenv("LINJAX_ALLOW_CHANGED_INPUTS")

    # Allowed explicitly: the run goes on and records what changed.
    resumed = train.run(longer, resume=True, progress=False, allow_changed_inputs=True)
    assert resumed is not None
    last = json.loads((run / "config.json").read_text())["history"][-1]
    assert last["event"] == "resume" and any("base model's weights" in c for c in last["inputs_changed"])

    # A run recorded before linjax kept fingerprints loads as before.
    manifest = json.loads((run / "linjax.json").read_text())
    del manifest["inputs"]
    (run / "linjax.json").write_text(json.dumps(manifest))
    linjax.load(str(run))
    assert trained is not None


# ----------------------------------------------------------------------------- 4. crashes, kills and signals

# `linjax train ARGV` that SIGKILLs itself at POINT of `save_trained`:
#   before_swap   the new parameters are written beside trainable/, not yet swapped in
#   inside_swap   the earlier trainable/ is set aside, the new one not yet renamed into place
KILLED_IN_SAVE_TRAINED = r"""
import os, signal, sys
from linjax import files
from linjax.convert import checkpoint

point, argv = sys.argv[1], sys.argv[2:]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
swap_in = files.swap_in
def killing_swap_in(new, directory):
    if point == "before_swap": die()
    rename = os.rename
    def killing_rename(src, dst):
        rename(src, dst)
        if ".linjax-old-" in os.path.basename(dst): die()
    os.rename = killing_rename
    swap_in(new, directory)
checkpoint.swap_in = killing_swap_in

from linjax.app.cli import main
main(["train", *argv, "--no-progress"])
"""


def test_a_kill_inside_save_trained_leaves_a_run_that_resumes(tiny_source, corpus, tmp_path):
    def config(name, steps):
        return experiment(tmp_path / name, tiny_source, corpus, steps=steps, warmup_steps=0, checkpoint_every=1)

    train.run(config("reference", 2), progress=False)
    reference = train.run(config("reference", 3), resume=True, progress=False)
    run = tmp_path / "killed"
    config_path = tmp_path / "killed.toml"
    _write_toml(config_path, config("killed", 2))

    done = python(KILLED_IN_SAVE_TRAINED, "before_swap", config_path, cwd=tmp_path)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert not (run / "trainable").exists() and glob.glob(str(run / ".trainable.linjax-new-*"))
    train.run(config("killed", 2), resume=True, progress=False)  # its last checkpoint is the last step
    assert (run / "trainable").is_dir() and leftovers(run) == []

    done = python(KILLED_IN_SAVE_TRAINED, "inside_swap", config_path, "--resume", "--set", "train.steps=3",
                  cwd=tmp_path)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert not (run / "trainable").exists() and glob.glob(str(run / ".trainable.linjax-old-*"))
    assert json.loads((run / "linjax.json").read_text())["steps"] == 2
    before_the_kill = linjax.load(str(run))[0]  # the earlier parameters, set aside, with their manifest
    resumed = train.run(config("killed", 3), resume=True, progress=False)  # the earlier one comes back first
    assert any(not np.array_equal(a, b) for a, b in zip(trainable_leaves(before_the_kill), trainable_leaves(resumed)))
    assert leftovers(run) == []
    assert_same_parameters(resumed, reference)
    assert_same_parameters(linjax.load(str(run))[0], reference)


KILLED_IN_EXPORT_SWAP = r"""
import os, signal, sys
rename = os.rename
def killing_rename(src, dst):
    rename(src, dst)
    if ".linjax-old-" in os.path.basename(dst): os.kill(os.getpid(), signal.SIGKILL)
os.rename = killing_rename
from linjax.app.cli import main
main(["export", *sys.argv[1:]])
"""


def test_a_kill_inside_the_export_swap_is_undone_by_the_next_export(tiny_source, tmp_path, capsys):
    out = tmp_path / "export"
    assert run_cli(["export", tiny_source, "--out", out], capsys)[0] == 0
    before = snapshot(out)
    done = python(KILLED_IN_EXPORT_SWAP, tiny_source, "--out", out)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert not out.exists() and len(leftovers(tmp_path)) == 2  # the earlier export set aside, and the new one
    (tmp_path / ".export.linjax-new-stale").mkdir()  # a staging folder of an older crash
    assert run_cli(["export", tiny_source, "--out", out], capsys)[0] == 0
    assert snapshot(out) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_a_checkpoint_at_the_step_boundary_and_resume_equals_an_uninterrupted_run(
        signum, tiny_source, corpus, tmp_path, monkeypatch, capsys):
    def config(name):  # no checkpoint of its own before the end: the one at step 2 is the signal's
        return experiment(tmp_path / name, tiny_source, corpus, steps=4, warmup_steps=0, checkpoint_every=10)

    reference = train.run(config("reference"), progress=False)
    config_path = tmp_path / "stopped.toml"
    _write_toml(config_path, config("stopped"))
    from linjax.train import sharding

    put_batch, steps, handler = sharding.put_batch, [], signal.getsignal(signum)

    def signalled_in_step_2(*args):  # called once per training step, as it starts
        steps.append(1)
        if len(steps) == 2:
            os.kill(os.getpid(), signum)
        return put_batch(*args)

    monkeypatch.setattr(sharding, "put_batch", signalled_in_step_2)
    status, _, err = run_cli(["train", config_path, "--no-progress"], capsys)
    monkeypatch.setattr(sharding, "put_batch", put_batch)
    assert status == 128 + signum, err  # 143 for SIGTERM, 130 for SIGINT
    assert len(steps) == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"stopped by {signal.Signals(signum).name} at step 2" in err and "--resume" in err
    assert sorted(os.listdir(tmp_path / "stopped" / "checkpoints")) == ["2"]
    assert signal.getsignal(signum) is handler  # the run's handler is gone with it
    resumed = train.run(config("stopped"), resume=True, progress=False)
    assert_same_parameters(resumed, reference)


def test_the_watchdog_removes_the_temporary_files_it_knows_of_before_ending_the_process(tmp_path):
    export = tmp_path / "linjax-lm-eval-x"
    done = python(f"""
        import os, time
        from linjax import heartbeat
        from linjax.app import watchdog
        os.makedirs({str(export / "model")!r})
        open({str(export / "model" / "model.safetensors")!r}, "wb").write(b"0" * 1000)
        with heartbeat.temporary({str(export)!r}), watchdog.watch("lm-eval", seconds=1):
            time.sleep(300)
    """, timeout=120)
    assert done.returncode == watchdog.EXIT_STATUS, done.stderr[-2000:]
    assert not export.exists()


def test_lm_eval_registers_its_temporary_export_with_the_watchdog(tiny_source, tmp_path):
    from linjax.convert.checkpoint import save_checkpoint
    from linjax.eval.lm_eval_bridge import hf_directory

    run = tmp_path / "checkpoint"  # not an HF directory: exported to a temporary one to be scored
    model, tokenizer = linjax.load(tiny_source)
    save_checkpoint(model, str(run), tokenizer)
    with hf_directory(str(run)) as directory:
        assert os.path.dirname(directory) in heartbeat.registered_temporaries()
    assert heartbeat.registered_temporaries() == set()


# ----------------------------------------------------------------------------- 5. paths as links resolve them


@pytest.mark.parametrize("through", ["a link to the run", "a link to its folder"])
def test_a_second_writer_through_a_symbolic_link_is_stopped(through, tiny_source, corpus, tmp_path, holder, capsys):
    """The lock belongs to the run, not to the path it was reached by: a `--resume` through a link to a run
    that another process is writing stops with one line, and the run's files stay as they were."""
    real = tmp_path / "real"
    run = real / "run"
    _write_toml(tmp_path / "run.toml", experiment(run, tiny_source, corpus, steps=2, warmup_steps=0))
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(train.load_experiment(str(tmp_path / "run.toml")).to_dict()))
    if through == "a link to the run":
        (tmp_path / "link").symlink_to(run)
        linked = tmp_path / "link"
    else:
        (tmp_path / "link").symlink_to(real)
        linked = tmp_path / "link" / "run"
    config_path = tmp_path / "linked.toml"
    _write_toml(config_path, experiment(linked, tiny_source, corpus, steps=2, warmup_steps=0))
    pid = holder(run)
    before = everything(run)
    status, _, err = run_cli(["train", config_path, "--resume", "--no-progress"], capsys)
    line = one_line_error(err)
    assert status == 2 and f"pid {pid}" in line and "another process" in line
    assert everything(run) == before


@pytest.mark.parametrize("where", ["inside the data folder, through a link", "the model folder",
                                   "holding the data file"])
@pytest.mark.parametrize("command", ["train", "run"])
def test_a_run_directory_overlapping_its_inputs_is_refused_before_anything_is_written(
        command, where, tiny_source, corpus, tmp_path, capsys):
    """A run directory inside the training data folder wrote config.json there, which every later training on
    that folder then read as a document: the run directory must lie apart from what the run reads."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(corpus, data / "corpus.jsonl")
    model = tmp_path / "model"
    shutil.copytree(tiny_source, model)
    (tmp_path / "data-link").symlink_to(data)
    run, named = {"inside the data folder, through a link": (tmp_path / "data-link" / "run", "training data"),
                  "the model folder": (model, "base model"),
                  "holding the data file": (data, "training data")}[where]
    config_path = tmp_path / "run.toml"
    _write_toml(config_path, experiment(run, str(model), str(data), steps=1, warmup_steps=0))
    before = everything(tmp_path)
    status, _, err = run_cli([command, config_path] + (["--no-progress"] if command == "train" else []), capsys)
    line = one_line_error(err)
    assert status == 2 and named in line and "run_dir" in line
    assert everything(tmp_path) == before


def test_resume_of_a_finished_run_on_a_read_only_file_system_changes_nothing(tiny_source, corpus, tmp_path):
    """`linjax train --resume` (and `linjax run`) of a finished run on a read-only mount: "nothing to do",
    exit 0, as documented; no lock is needed where nothing is written."""
    import dataclasses

    from tests.file_systems import in_namespace, linjax, read_only

    run = tmp_path / "runs" / "run"
    config = experiment(run, tiny_source, corpus, steps=1, warmup_steps=0)
    config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, run=()))  # convert, train, report
    _write_toml(tmp_path / "run.toml", config)
    pipeline.run(config, log=lambda *_: None, watchdog_seconds=None)
    before = everything(tmp_path / "runs")
    done = in_namespace(f"""
        {read_only(tmp_path / "runs")}
        {linjax("train", tmp_path / "run.toml", "--resume", "--no-progress")}
        {linjax("run", tmp_path / "run.toml")}
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{run} is finished (1 steps); nothing to do" in done.stdout
    assert "[linjax run] train: already done, skipped" in done.stdout and "error" not in done.stderr
    assert everything(tmp_path / "runs") == before
