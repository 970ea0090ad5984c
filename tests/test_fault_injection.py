"""Fault injection: linjax under the failures real machines have, on a tiny model, in the normal suite.

- kill -9 at moments drawn (a fixed seed) from all the file-system changes of `linjax train`, `export` and
  `run` (tests/fault_points.py), then the same command again: the result is an uninterrupted run's;
- flipped bytes and truncation in each kind of file linjax writes: one line naming the file, exit 2 (a
  training checkpoint is set aside and the run goes on from an intact one; the GGUF cache is converted again);
- a full file system (a real tmpfs, mounted in a user namespace: tests/file_systems.py): one line, exit 2, and
  the run, given space, resumes to the uninterrupted result;
- a read-only tree: what only reads works, what writes is one line;
- outputs given as symbolic links: written where the links lead, the links left as they are;
- SIGTERM during the final save, a checkpoint from before linjax recorded hashes cut short, a truncated GGUF.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest

import linjax
from linjax import train
from linjax.app import pipeline
from tests.fault_points import counted
from tests.file_systems import flip_bytes, in_namespace, read_only, tmpfs, truncate
from tests.file_systems import linjax as linjax_command
from tests.helpers import python_environment
from tests.test_reliability import leftovers, one_line_error, run_cli, snapshot
from tests.test_reliability_integrity import largest_file
from tests.test_reliability_runs import assert_same_parameters
from tests.test_train import _write_toml, corpus, experiment  # noqa: F401 (corpus is a fixture)

KILLED = -signal.SIGKILL


def killed_at(moment: int, *argv, cwd) -> subprocess.CompletedProcess:
    """`linjax ARGV` in a new process, SIGKILLed just before its `moment`-th file-system change."""
    return subprocess.run([sys.executable, "-m", "tests.fault_points", str(moment), *map(str, argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=600, env=python_environment())


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def assert_same_run(run, reference):
    """The same trained parameters and the same logged losses, step by step."""
    assert_same_parameters(linjax.load(str(run))[0], linjax.load(str(reference))[0])
    assert [(r["step"], round(r["loss"], 5)) for r in metrics(run)] == \
           [(r["step"], round(r["loss"], 5)) for r in metrics(reference)]


@pytest.fixture(scope="module")
def finished(tiny_source, tmp_path_factory):
    """(config, run directory) of a finished 2-step run, a checkpoint after each step."""
    root = tmp_path_factory.mktemp("finished")
    data = root / "corpus.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(9 + 5 * i))})
                              for i in range(10)))
    config = experiment(root / "run", tiny_source, str(data), steps=2, warmup_steps=0, checkpoint_every=1)
    train.run(config, progress=False)
    return config, root / "run"


# ----------------------------------------------------------------------------- kill -9 at any moment


def test_kill_9_at_random_moments_of_train_then_resume_equals_an_uninterrupted_run(tiny_source, corpus, tmp_path):
    def config(name):
        return experiment(tmp_path / name, tiny_source, corpus, steps=4, warmup_steps=0, checkpoint_every=2)

    with counted() as changes:
        train.run(config("reference"), progress=False)
    config_path = tmp_path / "killed.toml"
    _write_toml(config_path, config("killed"))
    for i, moment in enumerate(sorted(random.Random(11).sample(range(1, changes["events"] + 1), 2))):
        done = killed_at(moment, "train", config_path, "--no-progress", *(["--resume"] if i else []), cwd=tmp_path)
        assert done.returncode in (KILLED, 0), f"killed at change {moment}: {done.stderr[-2000:]}"
    train.run(config("killed"), resume=True, progress=False)
    assert_same_run(tmp_path / "killed", tmp_path / "reference")


def test_kill_9_at_a_random_moment_of_export_then_export_again_equals_an_uninterrupted_one(
        finished, tiny_source, tmp_path, capsys):
    _, run = finished
    reference, out = tmp_path / "reference", tmp_path / "export"
    with counted() as changes:
        assert run_cli(["export", run, "--out", reference], capsys)[0] == 0
    assert run_cli(["export", tiny_source, "--out", out], capsys)[0] == 0  # an earlier export, of another model
    earlier = snapshot(out)
    moment = random.Random(12).randint(1, changes["events"])
    done = killed_at(moment, "export", run, "--out", out, cwd=tmp_path)
    assert done.returncode in (KILLED, 0), f"killed at change {moment}: {done.stderr[-2000:]}"
    if out.exists() and not leftovers(tmp_path):  # before or after the swap: one export or the other, whole
        assert snapshot(out) in (earlier, snapshot(reference)), moment
    assert run_cli(["export", run, "--out", out], capsys)[0] == 0
    assert snapshot(out) == snapshot(reference) and leftovers(tmp_path) == []


def test_kill_9_at_a_random_moment_of_linjax_run_then_run_again_equals_an_uninterrupted_one(
        tiny_source, corpus, tmp_path):
    def config(name):
        c = experiment(tmp_path / name, tiny_source, corpus, steps=2, warmup_steps=0, checkpoint_every=1)
        return dataclasses.replace(c, eval=dataclasses.replace(c.eval, run=()))  # convert, train, report

    with counted() as changes:
        pipeline.run(config("reference"), log=lambda *_: None, watchdog_seconds=None)
    config_path = tmp_path / "killed.toml"
    _write_toml(config_path, config("killed"))
    moment = random.Random(13).randint(1, changes["events"])
    done = killed_at(moment, "run", config_path, cwd=tmp_path)
    assert done.returncode in (KILLED, 0), f"killed at change {moment}: {done.stderr[-2000:]}"
    pipeline.run(config("killed"), log=lambda *_: None, watchdog_seconds=None)
    assert pipeline.finished_stages(str(tmp_path / "killed")) == ["convert", "train", "report"]
    assert_same_run(tmp_path / "killed", tmp_path / "reference")


# ----------------------------------------------------------------------------- damaged files


def test_flipped_bytes_or_truncation_in_any_file_linjax_writes_is_named(finished, tiny_source, tmp_path, capsys,
                                                                        monkeypatch):
    from linjax.train.loop import _set_aside_damaged_checkpoints
    from tests.test_bad_input import write_gguf

    _, run = finished
    outputs = tmp_path / "outputs"
    for argv in (["export", run, "--out", outputs / "export"], ["convert", tiny_source, "--out", outputs / "convert"],
                 ["linearize", tiny_source, "--out", outputs / "linearized"]):
        assert run_cli(argv, capsys)[0] == 0
    shutil.copytree(run, outputs / "run")
    evaluate = ["eval", "perplexity", "{copy}", "--data", finished[0].data.paths[0], "--seq-len", "16",
                "--max-windows", "1"]
    lm_eval = ["eval", "lm-eval", "{copy}", "--tasks", "piqa", "--out", str(tmp_path / "lm-eval")]
    # (what was written, a file of it, the command that reads it)
    kinds = [("run", "trainable/*", evaluate), ("run", "linjax.json", evaluate),
             ("export", "model.safetensors", lm_eval), ("export", "config.json", lm_eval),
             ("export", "tokenizer.json", lm_eval), ("export", "modeling_linjax.py", lm_eval),
             ("convert", "model.safetensors", evaluate), ("convert", "params/*", evaluate),
             ("convert", "tokenizer/tokenizer.json", evaluate), ("linearized", "params/*", evaluate),
             ("linearized", "linjax.json", evaluate)]
    for (what, name, command), damage in [(kind, damage) for kind in kinds for damage in (flip_bytes, truncate)]:
        copy = tmp_path / "damaged" / what
        shutil.rmtree(copy.parent, ignore_errors=True)
        shutil.copytree(outputs / what, copy)
        path = largest_file(copy / name[:-2]) if name.endswith("/*") else str(copy / name)
        damage(path)
        status, _, err = run_cli([a.replace("{copy}", str(copy)) for a in command], capsys)
        line = one_line_error(err)
        assert status == 2 and path in line, (what, name, damage.__name__, line)

    # A training checkpoint: set aside, named, the run goes on from the one before (tests/test_reliability_integrity.py)
    for damage in (flip_bytes, truncate):
        copy = tmp_path / f"run-{damage.__name__}"
        shutil.copytree(run, copy)
        path = largest_file(copy / "checkpoints" / "2")
        damage(path)
        _set_aside_damaged_checkpoints(str(copy / "checkpoints"), str(copy))
        err = capsys.readouterr().err
        assert path in err and f"resuming {copy} from checkpoint 1" in err
        assert sorted(os.listdir(copy / "checkpoints")) == ["1"] and os.listdir(copy / "damaged-checkpoints") == ["2"]

    # The GGUF cache is linjax's own: damaged, it is converted again, saying so.
    monkeypatch.setenv("LINJAX_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(tmp_path / "model.gguf")
    first = linjax.load(gguf)[0]
    from linjax.convert.sources import gguf_cache_path

    for damage in (flip_bytes, truncate):
        damage(os.path.join(gguf_cache_path(gguf), "model.safetensors"))
        again = linjax.load(gguf)[0]
        assert "the GGUF cache is damaged" in capsys.readouterr().err
        assert_same_parameters_all(again, first)


def assert_same_parameters_all(a, b):
    import jax
    import numpy as np
    from flax import nnx

    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_checkpoint_from_before_the_hashes_cut_short_is_one_line(finished, tmp_path, capsys):
    """A run written before linjax recorded hashes: orbax's bare Exception for a file cut short becomes one
    line naming the checkpoint and what to do."""
    config, run = finished
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for step in os.listdir(copy / "checkpoints"):
        os.remove(copy / "checkpoints" / step / "linjax-sha256.json")
    shutil.rmtree(copy / "trainable")  # not finished: --resume restores the last checkpoint
    os.remove(copy / "linjax.json")
    truncate(largest_file(copy / "checkpoints" / "2"))
    config_path = tmp_path / "run.toml"
    _write_toml(config_path, dataclasses.replace(config, run_dir=str(copy)))
    status, _, err = run_cli(["train", config_path, "--resume", "--no-progress"], capsys)
    line = one_line_error(err)
    assert status == 2 and "checkpoint 2" in line and "cannot be read" in line and "--resume again" in line


def test_a_truncated_gguf_is_one_line(tmp_path, monkeypatch, capsys):
    from tests.test_bad_input import write_gguf

    monkeypatch.setenv("LINJAX_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "model.gguf")
    truncate(path, keep=0.6)
    status, _, err = run_cli(["convert", path, "--out", tmp_path / "out"], capsys)
    line = one_line_error(err)
    assert status == 2 and "model.gguf" in line and "truncated" in line
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- full, read-only, linked


def test_a_full_file_system_is_one_line_and_the_run_resumes_to_the_uninterrupted_result(
        tiny_source, corpus, tmp_path):
    """A real tmpfs with room for the first checkpoint and not the second: tensorstore reports ENOSPC as a
    ValueError, in many asyncio tasks at once; linjax says it once. Given space, the run resumes."""
    def config(run):
        return experiment(run, tiny_source, corpus, steps=4, warmup_steps=0, checkpoint_every=2)

    train.run(config(tmp_path / "reference"), progress=False)
    pages = sum(-(-os.path.getsize(os.path.join(root, n)) // 4096) for root, _, names in
                os.walk(tmp_path / "reference" / "checkpoints" / "2") for n in names)
    full = tmp_path / "full"
    full.mkdir()
    _write_toml(tmp_path / "full.toml", config(full / "run"))
    done = in_namespace(f"""
        {tmpfs(full, f"{pages * 4 * 3 // 2 + 64}k")}
        {linjax_command("train", tmp_path / "full.toml", "--no-progress")} 2> {tmp_path / "train.err"} \
            || echo $? > {tmp_path / "train.status"}
        cp -a {full / "run"} {tmp_path / "after"}
        {linjax_command("convert", tiny_source, "--out", full / "converted", "--format", "linjax")} \
            2> {tmp_path / "convert.err"} || echo $? > {tmp_path / "convert.status"}
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    for command in ("train", "convert"):
        assert (tmp_path / f"{command}.status").read_text().strip() == "2", command
        line = one_line_error((tmp_path / f"{command}.err").read_text())
        assert "No space left on device" in line, line
    assert "intact" in one_line_error((tmp_path / "train.err").read_text()) and "--resume" in \
        (tmp_path / "train.err").read_text()
    assert sorted(n for n in os.listdir(tmp_path / "after" / "checkpoints") if n.isdigit()) == ["2"]
    train.run(config(tmp_path / "after"), resume=True, progress=False)  # the space freed: from checkpoint 2
    assert_same_run(tmp_path / "after", tmp_path / "reference")


def test_a_read_only_tree_is_read_and_refuses_writes_with_one_line(finished, tmp_path):
    config, run = finished
    tree = tmp_path / "tree"
    shutil.copytree(run, tree / "run")
    _write_toml(tmp_path / "run.toml", dataclasses.replace(config, run_dir=str(tree / "run")))
    commands = [["train", str(tmp_path / "run.toml"), "--resume", "--no-progress"],
                ["eval", "perplexity", str(tree / "run"), "--data", config.data.paths[0], "--seq-len", "16",
                 "--max-windows", "1"],
                ["export", str(tree / "run"), "--out", str(tree / "export")]]
    script = ("import json, sys\nfrom linjax.app.cli import main\nfor argv in json.loads(sys.argv[1]):\n"
              "    print('---', flush=True); print('---', file=sys.stderr, flush=True)\n"
              "    try:\n        main(argv)\n        status = 0\n    except SystemExit as done:\n"
              "        status = done.code\n    print('status', status, flush=True)\n")
    import shlex

    done = in_namespace(f"""
        {read_only(tree)}
        {shlex.quote(sys.executable)} -c {shlex.quote(script)} {shlex.quote(json.dumps(commands))}
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    outs, errs = done.stdout.split("---\n")[1:], done.stderr.split("---\n")[1:]
    assert "status 0" in outs[0] and "is finished (2 steps); nothing to do" in outs[0], (outs[0], errs[0])
    assert "status 0" in outs[1] and "perplexity" in outs[1], errs[1]
    assert "status 2" in outs[2]
    line = one_line_error(errs[2])
    assert "Read-only file system" in line and str(tree / "export") in line
    assert not (tree / "export").exists()


def test_outputs_given_as_links_are_written_where_they_lead(finished, tiny_source, tmp_path, capsys):
    _, run = finished
    target = tmp_path / "exports" / "current"
    assert run_cli(["export", tiny_source, "--out", target], capsys)[0] == 0
    (tmp_path / "latest").symlink_to(target)
    status, _, err = run_cli(["export", run, "--out", tmp_path / "latest"], capsys)
    assert status == 0, err
    assert os.path.islink(tmp_path / "latest") and os.readlink(tmp_path / "latest") == str(target)
    assert json.loads((target / "config.json").read_text())["model_type"] == "linjax"  # the new export, there
    assert leftovers(tmp_path) == [] and leftovers(target.parent) == []

    results = tmp_path / "results" / "perplexity.json"
    results.parent.mkdir()
    results.write_text("{}")
    (tmp_path / "perplexity.json").symlink_to(results)
    argv = ["eval", "perplexity", run, "--data", finished[0].data.paths[0], "--seq-len", "16", "--max-windows", "1",
            "--out", tmp_path / "perplexity.json", "--overwrite"]
    assert run_cli(argv, capsys)[0] == 0
    assert os.path.islink(tmp_path / "perplexity.json") and json.loads(results.read_text())["results"]


SIGNALLED_IN_THE_FINAL_SAVE = r"""
import os, signal, sys
from linjax.train import loop

save_trained = loop.save_trained
def signalled(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's time limit, just as the finished run is saved
    return save_trained(*args, **kwargs)
loop.save_trained = signalled

from linjax.app.cli import main
main(["train", *sys.argv[1:], "--no-progress"])
"""


def test_sigterm_during_the_final_save_completes_it_first(tiny_source, corpus, tmp_path, capsys):
    config_path = tmp_path / "run.toml"
    _write_toml(config_path, experiment(tmp_path / "run", tiny_source, corpus, steps=1, warmup_steps=0))
    done = subprocess.run([sys.executable, "-c", SIGNALLED_IN_THE_FINAL_SAVE, str(config_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=python_environment())
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("linjax: stopped by SIGTERM during the final save")
    assert linjax.load(str(tmp_path / "run"))[0] is not None and leftovers(tmp_path / "run") == []
    status, out, err = run_cli(["train", config_path, "--resume", "--no-progress"], capsys)
    assert status == 0 and "is finished (1 steps); nothing to do" in out, err
