"""Integrity of what linjax wrote: every checkpoint and finished run carries the size and SHA-256 of its files,
written last and checked before its parameters are read. A damaged latest checkpoint gives way to the newest
intact one, saying so; damaged trained parameters are refused by `linjax.load` and so by every evaluation (one
line naming the file) and rebuilt by `--resume`; a parameter that is not finite is refused on load."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import linjax
from linjax import integrity, train
from tests.file_systems import flip_bytes, truncate
from tests.test_reliability import one_line_error, run_cli
from tests.test_reliability_runs import assert_same_parameters
from tests.test_train import _write_toml, corpus, experiment  # noqa: F401 (corpus is a fixture)


def largest_file(directory) -> str:
    """The largest file under `directory` but linjax's own record: where most of the parameters are."""
    files = [os.path.join(root, n) for root, _, names in os.walk(directory) for n in names if n != integrity.MANIFEST]
    return max(files, key=os.path.getsize)


def steps_logged(run) -> list[int]:
    return [json.loads(line)["step"] for line in open(run / "metrics.jsonl")]


def test_a_damaged_latest_checkpoint_gives_way_to_the_newest_intact_one(tiny_source, corpus, tmp_path, capsys):
    """Flipped bytes in checkpoint 3 and checkpoint 2 cut short: `--resume` names both files on stderr, sets them
    aside (kept, not deleted), goes on from checkpoint 1 and ends where an uninterrupted run ends."""
    def config(name, steps):
        return experiment(tmp_path / name, tiny_source, corpus, steps=steps, warmup_steps=0, checkpoint_every=1,
                          keep_checkpoints=3)

    reference = train.run(config("reference", 5), progress=False)
    run, config_path = tmp_path / "damaged", tmp_path / "damaged.toml"
    _write_toml(config_path, config("damaged", 3))
    assert run_cli(["train", config_path, "--no-progress"], capsys)[0] == 0
    flipped, cut = largest_file(run / "checkpoints" / "3"), largest_file(run / "checkpoints" / "2")
    flip_bytes(flipped)
    truncate(cut)

    status, _, err = run_cli(["train", config_path, "--resume", "--no-progress", "--set", "train.steps=5"], capsys)
    assert status == 0 and "Traceback" not in err, err
    assert f"{flipped} does not hold the bytes that were written" in err
    kept = run / "damaged-checkpoints" / "2" / os.path.relpath(cut, run / "checkpoints" / "2")
    assert f"{cut} has {os.path.getsize(kept)} bytes where" in err
    assert f"resuming {run} from checkpoint 1, the newest intact one" in err
    assert sorted(os.listdir(run / "damaged-checkpoints")) == ["2", "3"]  # set aside, not deleted
    assert steps_logged(run) == [1, 2, 3, 4, 5]
    assert_same_parameters(linjax.load(str(run))[0], reference)


def test_damaged_trained_parameters_are_refused_everywhere_and_rebuilt_by_resume(tiny_source, corpus, tmp_path, capsys):
    run, config_path = tmp_path / "run", tmp_path / "run.toml"
    _write_toml(config_path, experiment(run, tiny_source, corpus, steps=2, warmup_steps=0, checkpoint_every=1))
    assert run_cli(["train", config_path, "--no-progress"], capsys)[0] == 0
    intact = linjax.load(str(run))[0]
    damaged = largest_file(run / "trainable")
    flip_bytes(damaged)

    with pytest.raises(integrity.Damaged, match=f"{damaged} does not hold the bytes that were written"):
        linjax.load(str(run))
    status, out, err = run_cli(["eval", "perplexity", run, "--data", corpus, "--seq-len", "16", "--max-windows", "1"],
                               capsys)
    line = one_line_error(err)
    assert status == 2 and damaged in line and "--resume" in line and "perplexity" not in out

    status, _, err = run_cli(["train", config_path, "--resume", "--no-progress"], capsys)  # rebuilt from step 2
    assert status == 0 and f"{run}/trainable is damaged" in err, err
    assert_same_parameters(linjax.load(str(run))[0], intact)


def test_a_parameter_that_is_not_finite_is_refused_on_load(tiny_source, tmp_path, capsys):
    """A user's model (no record of linjax's) whose weights hold a NaN: one line naming the parameter."""
    from safetensors.numpy import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_source, model)
    (model / ".linjax-export").unlink()
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    save_file(tensors, str(model / "model.safetensors"))
    status, _, err = run_cli(["convert", model, "--out", tmp_path / "out"], capsys)
    line = one_line_error(err)
    assert status == 2 and "layers.1.mlp.up_proj.kernel holds 1 non-finite value" in line
    assert not (tmp_path / "out").exists()
