"""Training data: documents → tokens → EOS-separated packed sequences, resumable.

`PackedTextDataset` turns a source of documents into batches [batch, seq_len]
of token ids: every document is tokenised, followed by EOS, and appended to
one stream that is cut into consecutive sequences, so no token is dropped or
repeated (the stream's tail at the end of an epoch carries over into the next
epoch). The document order is a permutation drawn from the seed, fresh each
epoch. The position in the stream (epoch, documents consumed, leftover tokens)
is a small JSON-able dict saved with each checkpoint, so a resumed run reads
exactly the tokens the uninterrupted one would have.

Local sources: `.txt` (one document per file), `.jsonl` (one record per line),
`.json` (a record, or a list of records), and folders of these (recursively,
in sorted order). A record's text is its `text` field; Alpaca-style records
(`instruction`, `input`, `output`) are joined into one document.
"""

from __future__ import annotations

import os

import numpy as np

from linjax.files import read_file_documents, record_text

_SUFFIXES = (".txt", ".jsonl", ".json")


def training_files(paths) -> list[str]:
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                           for name in names if name.endswith(_SUFFIXES))
            if not found:
                raise ValueError(f"folder {path!r} holds no {', '.join(_SUFFIXES)} files")
            files.extend(found)
        elif os.path.isfile(path):
            if not path.endswith(_SUFFIXES):
                raise ValueError(f"{path!r}: training files must be {', '.join(_SUFFIXES)}")
            files.append(path)
        else:
            raise FileNotFoundError(f"training data path {path!r} does not exist")
    return files


def read_documents(paths, text_field: str = "text", deduplicate: bool = False) -> list[str]:
    """All non-empty documents of the given files and folders, in a fixed order; with `deduplicate`,
    each distinct text once, where it first appears (data sets assembled from overlapping sources
    repeat documents, which training would then read more than once per epoch)."""
    documents = [d for path in training_files(paths) for d in read_file_documents(path, text_field) if d.strip()]
    if deduplicate:
        documents = list(dict.fromkeys(documents))
    if not documents:
        raise ValueError(f"no non-empty documents in {list(paths)}")
    return documents


class LocalDocuments:
    """Documents held in memory; epoch e visits them in the permutation drawn from (seed, e)."""

    def __init__(self, paths, text_field: str = "text", deduplicate: bool = False):
        self.documents = read_documents(paths, text_field, deduplicate)

    def iterate(self, seed: int, epoch: int, start: int):
        order = np.random.default_rng([seed, epoch]).permutation(len(self.documents))
        for index in order[start:]:
            yield self.documents[index]


class StreamingDocuments:
    """A Hugging Face dataset, streamed; the order is the dataset's shuffle buffer with (seed + epoch)."""

    def __init__(self, name: str, config: str | None, split: str, text_field: str, buffer: int):
        from datasets import load_dataset  # on use only: it takes over half a second to import

        self.dataset = load_dataset(name, config, split=split, streaming=True)
        self.text_field, self.buffer = text_field, buffer

    def iterate(self, seed: int, epoch: int, start: int):
        stream = self.dataset.shuffle(seed=seed + epoch, buffer_size=self.buffer).skip(start)
        for record in stream:
            yield record_text(record, self.text_field, "dataset record")


class PackedTextDataset:
    """Batches [batch_size, seq_len] of int32 tokens from EOS-separated, packed documents."""

    def __init__(self, documents, tokenizer, *, seq_len: int, batch_size: int, seed: int):
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token to separate documents with")
        self.documents, self.tokenizer = documents, tokenizer
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.position = {"epoch": 0, "documents": 0, "leftover": []}

    def state(self) -> dict:
        """Where the stream stands; `restore(state)` continues from exactly here."""
        return {**self.position, "leftover": list(self.position["leftover"])}

    def restore(self, state: dict):
        self.position = {"epoch": int(state["epoch"]), "documents": int(state["documents"]),
                         "leftover": [int(t) for t in state["leftover"]]}

    def next_batch(self) -> np.ndarray:
        needed = self.seq_len * self.batch_size
        buffer = list(self.position["leftover"])
        epoch, consumed = self.position["epoch"], self.position["documents"]
        while len(buffer) < needed:
            progressed = False
            for text in self.documents.iterate(self.seed, epoch, consumed):
                buffer.extend(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                buffer.append(self.tokenizer.eos_token_id)
                consumed += 1
                progressed = True
                if len(buffer) >= needed:
                    break
            else:
                if not progressed and consumed == 0:
                    raise ValueError("the training data yielded no documents")
                epoch, consumed = epoch + 1, 0
        self.position = {"epoch": epoch, "documents": consumed, "leftover": buffer[needed:]}
        return np.asarray(buffer[:needed], np.int32).reshape(self.batch_size, self.seq_len)


def build_dataset(data_config, tokenizer, *, seq_len: int, batch_size: int, seed: int) -> PackedTextDataset:
    if data_config.dataset:
        documents = StreamingDocuments(data_config.dataset, data_config.dataset_config, data_config.split,
                                       data_config.text_field, data_config.shuffle_buffer)
    else:
        documents = LocalDocuments(data_config.paths, data_config.text_field, data_config.deduplicate)
    return PackedTextDataset(documents, tokenizer, seq_len=seq_len, batch_size=batch_size, seed=seed)
