"""RULER's single-needle retrieval tasks (S-NIAH), generated here, scored by string match.

    niah_single_1  haystack: a noise paragraph repeated; key: an adjective-noun pair; value: 7 digits
    niah_single_2  haystack: Paul Graham essays (or any text file);   key and value as above
    niah_single_3  haystack: as niah_single_2;                         value: a UUID

The needle "One of the special magic {numbers|uuids} for {key} is: {value}." goes
in at a depth chosen from RULER's 40 evenly spaced depths (0% … 100% of the
haystack, at the nearest sentence boundary); the haystack is sized so the whole prompt
(instruction, haystack, question and answer prefix) has the requested number of
tokens by the model's tokenizer (±2%). Generation is greedy; a sample scores 1
when the value appears in the answer, case-insensitively (RULER's string_match_all).

    linjax eval ruler MODEL --tasks niah_single_1,niah_single_2,niah_single_3 --lengths 1024,2048,4096 \\
        --samples N [--budgets 128,256,512 [--window-only]] [--haystack FILE] --out results.json

MODEL is full attention (one variant), linearized (`--budgets`: re-read at each cache
budget, sinks + window = budget), or full attention with `--window-only --budgets`: the
same budgets with sinks + window softmax alone, the baseline without a linear state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import uuid

import numpy as np

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = np.linspace(0.0, 1.0, 40)
TEMPLATE = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {kind} afterwards.\n{context}\n"
            "What are all the special magic {kind} for {key} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {kind} for {key} mentioned in the provided text are"
NEW_TOKENS = {"numbers": 24, "uuids": 48}

_ADJECTIVES = ("abrasive", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly",
               "keen", "lively", "mellow", "nimble", "orange", "polite", "quiet", "rapid", "silent", "tidy",
               "upbeat", "vivid", "wary", "young", "zesty", "bitter", "clever", "damp", "faint", "grumpy")
_NOUNS = ("anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket",
          "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quilt", "river", "saddle", "tunnel",
          "umbrella", "violin", "walnut", "yacht", "zebra", "beacon", "cactus", "feather", "glacier", "hammer")


@dataclasses.dataclass(frozen=True)
class Sample:
    task: str
    prompt: str  # everything the model reads, answer prefix included
    answers: tuple[str, ...]
    needle: str
    depth: float  # requested depth, a fraction of the haystack
    max_new_tokens: int


def score(prediction: str, answers) -> float:
    """RULER's string_match_all: the fraction of reference values found in the prediction, case-insensitively."""
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]


def read_haystack(path: str) -> list[str]:
    """Sentences of a haystack file: RULER's PaulGrahamEssays.json ({"text"}), a .jsonl of {"text"}, or text."""
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    if path.endswith(".json"):
        data = json.loads(raw)
        raw = data["text"] if isinstance(data, dict) else " ".join(d["text"] for d in data)
    elif path.endswith(".jsonl"):
        raw = " ".join(json.loads(line)["text"] for line in raw.splitlines() if line.strip())
    sentences = _sentences(raw)
    if len(sentences) < 10:
        raise ValueError(f"{path}: too little text for a haystack ({len(sentences)} sentences)")
    return sentences


def default_haystack() -> str | None:
    from linjax.eval.data import data_file

    return data_file("ruler", "PaulGrahamEssays.json")


class Generator:
    """Builds S-NIAH samples of an exact token length for one tokenizer."""

    def __init__(self, tokenizer, haystack: str | None = None):
        self.tokenizer = tokenizer
        self.haystack_path = haystack or default_haystack()
        self._essay = None

    def _count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _filler(self, task: str) -> list[str]:
        if task == "niah_single_1":
            return _sentences(NOISE)
        if self._essay is None:
            if self.haystack_path is None:
                raise ValueError(f"{task} needs a haystack text: pass --haystack FILE (e.g. RULER's "
                                 "PaulGrahamEssays.json) or set LINJAX_DATA_DIR")
            self._essay = read_haystack(self.haystack_path)
        return self._essay

    def _prompt(self, filler, n, needle, depth, kind, key):
        """The prompt with the first n filler words (sentences cycled) and the needle at the
        sentence boundary nearest to `depth` of them."""
        words = []
        while len(words) < n:
            words += " ".join(filler).split()
        words = words[:n]
        boundaries = [0] + [i + 1 for i, w in enumerate(words) if w.endswith((".", "!", "?"))] + [n]
        at = min(boundaries, key=lambda b: abs(b - depth * n))
        context = " ".join(words[:at] + [needle] + words[at:])
        return TEMPLATE.format(kind=kind, context=context, key=key) + ANSWER_PREFIX.format(kind=kind, key=key)

    def sample(self, task: str, length: int, rng: np.random.Generator, depth: float | None = None) -> Sample:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
        kind = "uuids" if task == "niah_single_3" else "numbers"
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        value = (str(uuid.UUID(int=int(rng.integers(0, 2**63)) << 64 | int(rng.integers(0, 2**63))))
                 if kind == "uuids" else str(int(rng.integers(1_000_000, 10_000_000))))
        needle = f"One of the special magic {kind} for {key} is: {value}."
        depth = float(rng.choice(DEPTHS)) if depth is None else depth
        filler = self._filler(task)
        if self._count(self._prompt(filler, 1, needle, depth, kind, key)) > length:
            raise ValueError(f"{length} tokens cannot hold even the instruction and the needle")
        low, high = 1, 2
        while self._count(self._prompt(filler, high, needle, depth, kind, key)) <= length:
            low, high = high, high * 2
        while high - low > 1:  # the most filler words whose prompt still fits
            mid = (low + high) // 2
            if self._count(self._prompt(filler, mid, needle, depth, kind, key)) <= length:
                low = mid
            else:
                high = mid
        prompt = self._prompt(filler, low, needle, depth, kind, key)
        return Sample(task, prompt, (value,), needle, depth, NEW_TOKENS[kind])


PREFILL_CHUNK = 256  # fixed prefill shapes: one compilation serves every prompt of a length (generate.py)


def evaluate(model, tokenizer, samples: list[Sample], progress: bool = True) -> list[dict]:
    """Greedy answers and scores of `samples` (one at a time: prompts differ in length)."""
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    from linjax.generate import generate

    rows = []
    # One cache size for all samples (prompts are within 2% of each other), so one compilation.
    capacity = max(len(tokenizer(s.prompt, add_special_tokens=False)["input_ids"]) + s.max_new_tokens
                   for s in samples) if samples else 0
    for s in tqdm(samples, desc="S-NIAH", disable=not progress):
        ids = tokenizer(s.prompt, add_special_tokens=False)["input_ids"]
        out = generate(model, jnp.asarray([ids], jnp.int32), s.max_new_tokens, prefill_chunk=PREFILL_CHUNK,
                       cache_length=capacity)
        answer = tokenizer.decode(np.asarray(out[0, len(ids):]).tolist(), skip_special_tokens=True)
        rows.append({"task": s.task, "tokens": len(ids), "depth": s.depth, "answers": list(s.answers),
                     "prediction": answer, "score": score(answer, s.answers)})
    return rows


def budget_variants(model, budgets, sinks: int, window_only: bool = False) -> dict:
    """{label: model} to evaluate: the model itself (no budgets), or one variant per cache budget b
    (sinks + window = b): a linearized model re-read at that budget (`with_budget`), or, with
    `window_only`, the full-attention model restricted to sinks + window softmax with no linear
    term (mechanism "window", the training-free baseline)."""
    import linjax
    from linjax.linearize import with_budget

    linearized = getattr(model, "linearize_config", None) is not None
    if window_only and (linearized or not budgets):
        raise ValueError("--window-only turns a full-attention model into sinks + window attention at each "
                         "--budgets value: give a plain (not linearized) model and --budgets, e.g. 128,512")
    if budgets and not linearized and not window_only:
        raise ValueError("cache budgets apply to a linearized model; for the window-only baseline of a "
                         "full-attention model add --window-only")
    bad = [b for b in budgets or () if b <= sinks]
    if bad:
        raise ValueError(f"budgets {bad} leave no window after {sinks} sinks; each budget must exceed --sinks")
    if not budgets:
        if not linearized:
            return {"full attention": model}
        lin = model.linearize_config
        return {f"as trained (sinks {lin.sinks}, window {lin.window})" if lin.window else "as trained (no window)":
                model}
    if window_only:
        return {f"window only, budget {b} (sinks {sinks}, window {b - sinks})":
                linjax.linearize(model, linjax.LinearizeConfig(mechanism="window", sinks=sinks, window=b - sinks))
                for b in budgets}
    return {f"budget {b} (sinks {sinks}, window {b - sinks})": with_budget(model, sinks=sinks, window=b - sinks)
            for b in budgets}


def run(model_spec: str, *, tasks, lengths, samples: int, out: str, budgets=None, sinks: int = 8,
        window_only: bool = False, haystack: str | None = None, seed: int = 0, progress: bool = True) -> dict:
    """S-NIAH accuracy per task × length (× cache budget); writes `out` (+ .md) after every cell."""
    from linjax.eval.models import load_model

    model, tokenizer, name = load_model(model_spec)
    if tokenizer is None:
        raise ValueError(f"{model_spec} has no tokenizer; S-NIAH needs one")
    generator = Generator(tokenizer, haystack)
    variants = budget_variants(model, budgets, sinks, window_only)
    settings = {"tasks": list(tasks), "lengths": list(lengths), "samples": samples, "budgets": list(budgets or []),
                "sinks": sinks, "window_only": window_only, "seed": seed,
                "haystack": os.path.abspath(generator.haystack_path) if generator.haystack_path else None}
    results, details = [], []
    for task in tasks:
        for length in lengths:
            rng = np.random.default_rng([seed, TASKS.index(task) if task in TASKS else 99, length])
            batch = [generator.sample(task, length, rng) for _ in range(samples)]
            for variant, m in variants.items():
                rows = evaluate(m, tokenizer, batch, progress)
                accuracy = float(np.mean([r["score"] for r in rows]))
                results.append({"task": task, "length": length, "variant": variant, "accuracy": accuracy,
                                "samples": len(rows)})
                details += [dict(r, variant=variant, length=length) for r in rows]
                if progress:
                    print(f"{task} @ {length} [{variant}]: {accuracy:.2f}", flush=True)
                result = _write(out, name, settings, results, details)  # after every cell: a crash keeps them
    return result


def _write(out: str, name: str, settings: dict, results: list, details: list) -> dict:
    """The results JSON and a Markdown table beside it (same name, .md), atomically."""
    from linjax.eval.cli import write_json

    table = ["| task | length | cache | accuracy | samples |", "|---|---|---|---|---|"]
    table += [f"| {r['task']} | {r['length']} | {r['variant']} | {r['accuracy']:.2f} | {r['samples']} |"
              for r in results]
    result = {"model": name, "settings": settings, "results": results, "table_markdown": "\n".join(table),
              "samples": details}
    write_json(out, result)
    markdown = os.path.splitext(out)[0] + ".md"
    with open(markdown + ".tmp", "w") as f:
        f.write(f"# S-NIAH: {name}\n\n" + result["table_markdown"] + "\n")
    os.replace(markdown + ".tmp", markdown)
    return result
