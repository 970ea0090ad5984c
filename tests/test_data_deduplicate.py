"""`data.deduplicate`: each distinct training document read once (the 281 webtext "agreement"
documents repeat "majority" ones); off by default, so recorded runs read what they read."""

import json
import os

import pytest

from linjax.experiment import from_dict, setting_changes
from linjax.train.data import read_documents
from tests.helpers import missing


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def test_repeated_documents_are_read_once_in_first_appearance_order(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["one", "two", "three"])
    write_jsonl(tmp_path / "b.jsonl", ["two", "four", "one", "four"])
    assert read_documents([str(tmp_path)]) == ["one", "two", "three", "two", "four", "one", "four"]
    assert read_documents([str(tmp_path)], deduplicate=True) == ["one", "two", "three", "four"]
    # and training reads them so when the experiment asks for it
    from types import SimpleNamespace

    from linjax.train.data import build_dataset

    data = from_dict({"run_dir": "r", "data": {"paths": [str(tmp_path)], "deduplicate": True}}).data
    dataset = build_dataset(data, SimpleNamespace(eos_token_id=0), seq_len=4, batch_size=1, seed=0)
    assert dataset.documents.documents == ["one", "two", "three", "four"]


def test_the_setting_is_checked_and_leaves_recorded_runs_unchanged():
    raw = {"run_dir": "r", "data": {"paths": ["x"]}}
    assert from_dict({**raw, "data": {"paths": ["x"], "deduplicate": True}}).data.deduplicate is True
    with pytest.raises(ValueError, match="data.deduplicate must be true or false"):
        from_dict({**raw, "data": {"paths": ["x"], "deduplicate": "yes"}})
    with pytest.raises(ValueError, match="local `paths`"):
        from_dict({**raw, "data": {"dataset": "some/set", "deduplicate": True}})
    recorded = from_dict(raw).to_dict()
    del recorded["data"]["deduplicate"]  # a run recorded before the setting existed
    assert setting_changes(recorded, from_dict(raw).to_dict()) == {}


def test_the_claims_training_text_holds_548_distinct_documents():
    root = os.environ.get("LINJAX_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))
    paths = [os.path.join(root, "webtext"), os.path.join(root, "ruler", "gkamradt_PaulGrahamEssays")]
    if not all(os.path.isdir(p) for p in paths):
        missing(f"the training text is not under {root} (set LINJAX_DATA_DIR)")
    assert len(read_documents(paths)) == 829
    assert len(read_documents(paths, deduplicate=True)) == 548
