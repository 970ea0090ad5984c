"""A resumed run is the experiment it claims to be: `linjax train --resume` and
`linjax run` refuse settings that would change a run already under way or a finished stage."""

import dataclasses
import json
import os

import pytest

from linjax import train
from linjax.app import pipeline
from tests.test_train import corpus, experiment  # noqa: F401 (corpus is a fixture)


def stored(run_dir):
    with open(os.path.join(run_dir, "config.json")) as f:
        return json.load(f)


def test_resume_refuses_a_changed_experiment_and_records_a_longer_run(tiny_source, corpus, tmp_path):
    run_dir = tmp_path / "run"

    def make(data=corpus, **fields):
        return experiment(run_dir, tiny_source, data, **{"steps": 2, "warmup_steps": 0, **fields})

    config = make()
    train.run(config, progress=False)
    started = stored(run_dir)
    changed = {"train.lr None → 0.002": make(lr=0.002),
               "linearize.mechanism 'gdn' → 'gla'": dataclasses.replace(
                   config, linearize=dataclasses.replace(config.linearize, mechanism="gla")),
               "data.paths": make(data=str(tmp_path / "other.jsonl"))}
    for names, other in changed.items():
        with pytest.raises(ValueError, match="was started with other settings: " + names.split(" ")[0]) as err:
            train.run(other, resume=True, progress=False)
        assert names in str(err.value) and "\n" not in str(err.value)
        assert stored(run_dir) == started  # the record is untouched
    with pytest.raises(ValueError, match="train.steps=1 is below the"):
        train.run(make(steps=1), resume=True, progress=False)

    # A run recorded before linjax had a setting used its default: the same experiment.
    older = {**started, "linearize": {k: v for k, v in started["linearize"].items() if k != "gate_rank"}}
    (run_dir / "config.json").write_text(json.dumps(older))
    # Extending the run and saving more often are allowed, and the record says so.
    train.run(make(steps=3, checkpoint_every=1), resume=True, progress=False)
    record = stored(run_dir)
    assert record["train"]["steps"] == 3
    assert [h["event"] for h in record["history"]] == ["start", "resume"]
    assert record["history"][1]["at_step"] == 2
    assert [h["device"] for h in record["history"]] == ["cpu", "cpu"]  # each start names what it ran on
    assert record["history"][1]["changed"] == {"train.checkpoint_every": [2, 1], "train.steps": [2, 3]}
    with open(run_dir / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]


def test_a_run_from_before_the_scale_default_moved_resumes_only_with_its_scale_pinned():
    """linearize.scale's default moved from FLA's Dk^-1/2 (stored as null) to 1: a run that stored null,
    or was recorded before linjax had the setting, is another experiment under today's default, and
    the refusal says how to keep its scale; `scale = "fla_default"` resumes it."""
    from linjax.experiment import OPERATIONAL, describe_changes, from_dict, setting_changes

    raw = {"run_dir": "run", "linearize": {"mechanism": "gdn"}}
    today = from_dict(raw).to_dict()
    assert today["linearize"]["scale"] == 1.0
    pinned = from_dict({**raw, "linearize": {"mechanism": "gdn", "scale": "fla_default"}}).to_dict()
    before_the_setting = {**today, "linearize": {k: v for k, v in today["linearize"].items() if k != "scale"}}
    stored_null = {**today, "linearize": {**today["linearize"], "scale": None}}
    for stored in (before_the_setting, stored_null):
        changes = setting_changes(stored, today, ignore=OPERATIONAL)
        assert changes == {"linearize.scale": (None, 1.0)}
        assert 'scale = "fla_default"' in describe_changes(changes)
        assert setting_changes(stored, pinned, ignore=OPERATIONAL) == {}
    assert "fla_default" not in describe_changes({"linearize.scale": (0.5, 1.0)})


def test_run_refuses_a_finished_stage_whose_settings_changed(tiny_source, corpus, tmp_path):
    run_dir = tmp_path / "run"
    base = experiment(run_dir, tiny_source, corpus, steps=2)

    def with_eval(config, **fields):
        fields = {"run": ("perplexity",), "perplexity_data": corpus, "perplexity_seq_len": 32,
                  "perplexity_windows": 1, **fields}
        return dataclasses.replace(config, eval=dataclasses.replace(config.eval, **fields))

    config = with_eval(base)
    pipeline.run(config, log=lambda *_: None, watchdog_seconds=None)
    markers = {name: (run_dir / "stages" / name).read_text() for name in os.listdir(run_dir / "stages")}
    assert sorted(markers) == ["convert.json", "perplexity.json", "report.json", "train.json"]

    with pytest.raises(ValueError, match=r"train \(train.lr None → 0.001\)") as err:
        pipeline.run(with_eval(experiment(run_dir, tiny_source, corpus, steps=2, lr=1e-3)), watchdog_seconds=None)
    assert "new run_dir" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"perplexity \(eval.perplexity_seq_len 32 → 16\)"):
        pipeline.run(with_eval(base, perplexity_seq_len=16), watchdog_seconds=None)
    with pytest.raises(ValueError, match=r"train \(train.steps 2 → 3\)"):
        pipeline.run(with_eval(experiment(run_dir, tiny_source, corpus, steps=3)), watchdog_seconds=None)
    assert {name: (run_dir / "stages" / name).read_text() for name in os.listdir(run_dir / "stages")} == markers

    # Operational settings may change: every finished stage is skipped.
    lines = []
    pipeline.run(with_eval(experiment(run_dir, tiny_source, corpus, steps=2, checkpoint_every=1)), log=lines.append,
                 watchdog_seconds=None)
    assert sum("already done, skipped" in line for line in lines) == 4
