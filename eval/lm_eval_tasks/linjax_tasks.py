"""Loaders (lm-eval `custom_dataset`) and prompt functions of linjax's local lm-eval tasks.

Each `load_*` reads the public files of the data folder (see /work/shared/data/README.md)
and returns a `datasets.DatasetDict` whose documents have the fields of the Hugging Face
dataset lm-eval's standard task reads, so that the YAML files beside this module can use
the standard prompts, targets and metrics unchanged. The folder comes from the task
metadata `linjax_data_dir` (set by `linjax.eval.lm_eval_bridge` through
`TaskManager(metadata=...)`), else `$LINJAX_DATA_DIR`.
"""

from __future__ import annotations

import bz2
import csv
import json
import os
import re


def data_dir(linjax_data_dir=None) -> str:
    path = linjax_data_dir or os.environ.get("LINJAX_DATA_DIR")
    if not path or not os.path.isdir(path):
        raise FileNotFoundError(f"linjax lm-eval tasks need the data folder (metadata linjax_data_dir or "
                                f"$LINJAX_DATA_DIR), got {path!r}")
    return path


def _jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _dataset_dict(splits):
    import datasets

    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


# ---------------------------------------------------------------- PIQA
def read_piqa(root):
    docs = _jsonl(os.path.join(root, "piqa", "valid.jsonl"))
    labels = _lines(os.path.join(root, "piqa", "valid-labels.lst"))
    if len(labels) != len(docs):
        raise ValueError(f"piqa: {len(docs)} questions but {len(labels)} labels")
    return [{"goal": d["goal"], "sol1": d["sol1"], "sol2": d["sol2"], "label": int(y)} for d, y in zip(docs, labels)]


def load_piqa(linjax_data_dir=None, **_):
    return _dataset_dict({"validation": read_piqa(data_dir(linjax_data_dir))})


# ---------------------------------------------------------------- ARC (AI2 jsonl)
def read_arc(path):
    """Rows in the `allenai/ai2_arc` layout: id, question (the stem), choices{text,label}, answerKey."""
    rows = []
    for d in _jsonl(path):
        q = d["question"]
        choices = q["choices"]
        rows.append({"id": d["id"], "question": q["stem"],
                     "choices": {"text": [c["text"] for c in choices], "label": [c["label"] for c in choices]},
                     "answerKey": d["answerKey"]})
    return rows


def _load_arc(name, linjax_data_dir):
    root = os.path.join(data_dir(linjax_data_dir), "arc")
    test = os.path.join(root, f"{name}-Test.jsonl")
    if not os.path.exists(test):
        raise FileNotFoundError(f"{test} is absent (ARC's AI2 jsonl test file)")
    train = os.path.join(root, f"{name}-Train.jsonl")
    splits = _dataset_dict({"test": read_arc(test)})
    # few-shot examples come from the train split; without its file, an empty one (0-shot only)
    splits["train"] = _dataset_dict({"train": read_arc(train)})["train"] if os.path.exists(train) \
        else splits["test"].select([])
    return splits


def load_arc_easy(linjax_data_dir=None, **_):
    return _load_arc("ARC-Easy", linjax_data_dir)


def load_arc_challenge(linjax_data_dir=None, **_):
    return _load_arc("ARC-Challenge", linjax_data_dir)


# ---------------------------------------------------------------- HellaSwag (6-line text format)
def preprocess(text):
    """lm-eval's hellaswag preprocessing (tasks/hellaswag/utils.py)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


_LAST_SENTENCE = re.compile(r"^(.*[.!?] )([a-z][^.!?]*)$", re.S)


def capitalize_ctx_b(ctx):
    """The file joins ctx_a and ctx_b without lm-eval's `ctx_b.capitalize()`: approximate it by
    capitalizing a trailing lower-case fragment that follows the last sentence end."""
    m = _LAST_SENTENCE.match(ctx)
    return m.group(1) + m.group(2).capitalize() if m else ctx


def read_hellaswag(path):
    with bz2.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if len(lines) % 6:
        raise ValueError(f"{path}: {len(lines)} lines, not a multiple of 6")
    rows = []
    for i in range(0, len(lines), 6):
        ctx, gold, endings = lines[i], int(lines[i + 1]), lines[i + 2:i + 6]
        rows.append({"query": preprocess(capitalize_ctx_b(ctx)), "choices": [preprocess(e) for e in endings],
                     "label": str(gold), "gold": gold})
    return rows


def load_hellaswag(linjax_data_dir=None, **_):
    path = os.path.join(data_dir(linjax_data_dir), "hellaswag", "hellaswag_val_full.txt.bz2")
    return _dataset_dict({"validation": read_hellaswag(path)})


# ---------------------------------------------------------------- WinoGrande (dev.jsonl + dev-labels.lst)
def read_winogrande(root):
    docs = _jsonl(os.path.join(root, "winogrande", "dev.jsonl"))
    labels_path = os.path.join(root, "winogrande", "dev-labels.lst")
    labels = _lines(labels_path) if os.path.exists(labels_path) else None
    if labels is not None and len(labels) != len(docs):
        raise ValueError(f"winogrande: {len(docs)} sentences but {len(labels)} labels")
    rows = []
    for i, d in enumerate(docs):
        answer = str(d["answer"]) if d.get("answer") not in (None, "") else (labels[i] if labels else None)
        if answer not in ("1", "2"):
            raise ValueError(f"winogrande item {i}: no answer (1 or 2) in dev.jsonl or dev-labels.lst")
        rows.append({"sentence": d["sentence"], "option1": d["option1"], "option2": d["option2"], "answer": answer})
    return rows


def load_winogrande(linjax_data_dir=None, **_):
    return _dataset_dict({"validation": read_winogrande(data_dir(linjax_data_dir))})


# lm-eval's partial scoring (tasks/winogrande/preprocess_winogrande.py): the contexts differ
# (the sentence up to "_" with each option), the continuation after "_" is scored.
def winogrande_doc_to_text(doc):
    return {"1": 0, "2": 1}[doc["answer"]]


def winogrande_doc_to_target(doc):
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def winogrande_doc_to_choice(doc):
    idx = doc["sentence"].index("_")
    return [doc["sentence"][:idx] + opt for opt in (doc["option1"], doc["option2"])]


# ---------------------------------------------------------------- MMLU (cais/mmlu csv export)
def read_mmlu(path, subject):
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        for r in csv.DictReader(f):
            rows.append({"question": r["question"], "subject": subject,
                         "choices": [r[f"choice{k}"] for k in range(4)], "answer": int(r["answer"])})
    return rows


def load_mmlu(linjax_data_dir=None, subject=None, **_):
    root = os.path.join(data_dir(linjax_data_dir), "mmlu")
    return _dataset_dict({"test": read_mmlu(os.path.join(root, "test", f"{subject}_test.csv"), subject),
                          "dev": read_mmlu(os.path.join(root, "dev", f"{subject}_dev.csv"), subject)})


# ---------------------------------------------------------------- LAMBADA (OpenAI jsonl)
def load_lambada_openai(linjax_data_dir=None, **_):
    path = os.path.join(data_dir(linjax_data_dir), "lambada", "lambada_test.jsonl")
    rows = [{"text": d["text"]} for d in _jsonl(path)]
    return _dataset_dict({"test": rows})
