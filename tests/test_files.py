"""linjax.files: a failed write leaves the earlier file and nothing else; documents from each file type."""

import json
import os

import pytest

from linjax.files import atomic_file, read_file_documents, write_json, write_text


def test_a_failed_write_keeps_the_earlier_file_and_leaves_nothing_beside_it(tmp_path):
    path = str(tmp_path / "out" / "result.json")  # the folder is created
    write_json(path, {"a": 1})
    with pytest.raises(OSError, match="No space"), atomic_file(path) as f:
        f.write('{"a": ')
        raise OSError(28, "No space left on device")
    assert json.loads(open(path).read()) == {"a": 1}
    assert os.listdir(tmp_path / "out") == ["result.json"]
    write_text(path, "done\n")
    assert open(path).read() == "done\n" and os.listdir(tmp_path / "out") == ["result.json"]


def test_documents_of_each_file_type(tmp_path):
    text = tmp_path / "essay.raw"
    text.write_text("one whole document\n\nover lines")
    lines = tmp_path / "corpus.jsonl"
    lines.write_text('{"text": "first"}\n\n"second"\n{"text": ""}\n')
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Add.", "input": "1 + 1", "output": "2"},
                                  {"instruction": "Greet.", "input": "", "output": "Hi"}]))
    assert read_file_documents(str(text)) == ["one whole document\n\nover lines"]
    assert read_file_documents(str(lines)) == ["first", "second", ""]
    assert read_file_documents(str(alpaca)) == ["Add.\n\n1 + 1\n\n2", "Greet.\n\nHi"]
    lines.write_text('{"text": "first"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: record has no 'text' field"):
        read_file_documents(str(lines))
