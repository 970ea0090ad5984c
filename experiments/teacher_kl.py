"""How close a trained row is to its teacher, next to how well it predicts the text: a row's cross-entropy,
the original model's, and KL(original ‖ row) per token, on WikiText-2 test and on the training text.

A LoRA stage trained by distillation (train.objective = "distillation") lowers the KL to the original model
and raises the cross-entropy on both texts; the same stage trained by CE does the opposite
(results/claims.md). This measures both quantities on the same tokens for each row.

    python experiments/teacher_kl.py RUN_DIR [RUN_DIR ...]     # writes RUN_DIR/eval/teacher-kl.json

The first 4 x 512 tokens of each text, in 512-token windows (the rows' training length).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np

import linjax
from linjax.files import write_json
from linjax.train.objectives import distillation_loss, lm_loss, next_token_loss, original_attention

DATA = os.environ.get("LINJAX_DATA_DIR", "../shared/data")
TEXTS = {"wikitext2_test": "wikitext/wikitext-2-raw-v1.test.nonblank.raw",
         "training_dclm": "webtext/dclm_majority_data.jsonl"}
WINDOWS, LENGTH = 4, 512


def text_of(name: str) -> str:
    path = os.path.join(DATA, TEXTS[name])
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            return "\n\n".join(json.loads(line)["text"] for line in f if line.strip())
        return f.read()


def measure(run_dir: str) -> dict:
    model, tokenizer = linjax.load(run_dir)

    @jax.jit
    def losses(tokens):
        teacher = lm_loss(model, model.hidden_states_under(tokens, original_attention)[:, :-1], tokens[:, 1:])
        return next_token_loss(model, tokens), teacher, distillation_loss(model, tokens)

    out = {"run": run_dir, "windows": WINDOWS, "seq_len": LENGTH}
    for name in TEXTS:
        ids = np.asarray(tokenizer.encode(text_of(name))[: WINDOWS * LENGTH], np.int32).reshape(WINDOWS, LENGTH)
        ce, teacher_ce, kl = (float(x) for x in losses(ids))
        out[name] = {"ce": ce, "teacher_ce": teacher_ce, "kl_teacher_to_row": kl}
    return out


def main(run_dirs):
    if not run_dirs:
        sys.exit("usage: python experiments/teacher_kl.py RUN_DIR [RUN_DIR ...]")
    for run_dir in run_dirs:
        result = measure(run_dir)
        write_json(os.path.join(run_dir, "eval", "teacher-kl.json"), result)
        print(run_dir, {k: {m: round(v, 4) for m, v in result[k].items()} for k in TEXTS})


if __name__ == "__main__":
    main(sys.argv[1:])
