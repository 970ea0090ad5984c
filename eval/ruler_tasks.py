"""RULER's synthetic tasks, generated for one tokenizer at a requested prompt length.

Retrieval. A needle is "One of the special magic {numbers|uuids} for {key} is: {value}."; keys are
adjective-noun pairs, values 7-digit numbers, unless said otherwise.
    niah_single_1  haystack: a noise paragraph repeated; one needle
    niah_single_2  haystack: Paul Graham essays (or any text file); one needle
    niah_single_3  as niah_single_2 with a UUID value
    multikey       essay haystack, 4 needles with different keys; one key asked       (RULER's niah_multikey_1)
    multikey_2     haystack: distractor needles with other keys, one per line; one asked        (niah_multikey_2)
    multikey_3     as multikey_2 with UUID keys and values                                      (niah_multikey_3)
    multivalue     essay haystack, 4 needles with one key; all 4 values asked                    (niah_multivalue)
    multiquery     essay haystack, 4 needles with different keys; all 4 keys asked               (niah_multiquery)
Tracing and aggregation.
    vt   variable tracking: one chain of 4 hops, "VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE", ..., one statement
         a line among lines of the noise paragraph, after one worked example; answer: the 5 names holding the value
    cwe  common words extraction: after one worked example, a numbered list where 10 words appear often (30 times
         from 4,096 tokens on, else 6) and the others rarely (3 times, else once); answer: those 10
    fwe  frequent words extraction: random 6-letter "coded" words with Zipf counts (alpha 2) over a vocabulary
         of (length - 50) / 50 words; the most frequent is "...", noise; answer: the next 3

Needles go in at depths drawn from RULER's 40 evenly spaced ones (0% … 100% of the haystack, at the nearest
sentence or line boundary); the vt chain at random lines, in hop order. The filler is sized by binary search
so the whole prompt (instructions, haystack, question and answer prefix) has the requested number of tokens
by the model's tokenizer, ±2% (multikey_2/3 grow by whole distractor lines, about 25 and 80 tokens with
SmolLM2's tokenizer, so below about 4,096 tokens they can fall up to one line short of that). A sample
scores the fraction of its answers found in the generated text, case-insensitively (RULER's string_match_all).

cwe needs about 700 tokens (its worked example and the 10 words 6 times each) and, from the list of about
a thousand words in eval/ruler_words.py, reaches about 16K tokens with SmolLM2's tokenizer.

Templates, answer prefixes, generation lengths and the haystacks follow NVIDIA/RULER (scripts/data/synthetic/
niah.py, variable_tracking.py, common_words_extraction.py, freq_words_extraction.py, constants.py and
scripts/synthetic.yaml), with these differences: the length counts the prompt alone (RULER's includes the
tokens to generate); niah_single_* generate 24 (48 for UUIDs) tokens rather than 128 (the answer
prefix ends right before the value, which needs at most 25 tokens); vt's worked example has 3 noise
lines (RULER's fills 500 tokens); the words are lists of our own, so
cwe draws from about a thousand words (RULER: wonderwords' lists, then a larger English list).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import string
import uuid

import numpy as np

from linjax.eval.data import data_file
from linjax.eval.ruler_words import WORDS
from linjax.files import read_file_documents

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "multikey", "multikey_2", "multikey_3",
         "multivalue", "multiquery", "vt", "cwe", "fwe")
NEW_TOKENS = {"niah_single_1": 24, "niah_single_2": 24, "niah_single_3": 48, "multikey": 128, "multikey_2": 128,
              "multikey_3": 128, "multivalue": 128, "multiquery": 128, "vt": 30, "cwe": 120, "fwe": 50}
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = np.linspace(0.0, 1.0, 40)

TEMPLATE = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {kind} afterwards.\n{context}\n"
            "What are all the special magic {kind} for {key} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {kind} for {key} mentioned in the provided text are"
ONE_TEMPLATE = ("A special magic {kind} is hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the {kind} afterwards.\n{context}\n"
                "What is the special magic {kind} for {key} mentioned in the provided text?")
ONE_ANSWER_PREFIX = " The special magic {kind} for {key} mentioned in the provided text is"
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {value} in the text above.")
VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {count} variables "
                    "are assigned the value {value}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\n"
                "Question: What are the 10 most common words in the above list?")
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

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
    max_new_tokens: int
    needles: tuple[str, ...] = ()  # the statements inserted into the haystack in prompt order (vt: the chain)
    depths: tuple[float, ...] = ()  # where each was asked to go, a fraction of the haystack
    words: tuple[str, ...] = ()  # cwe: the numbered list's words in order; fwe: the coded text's

    @property
    def needle(self) -> str:
        return self.needles[0] if self.needles else ""

    @property
    def depth(self) -> float | None:
        return self.depths[0] if self.depths else None


def score(prediction: str, answers) -> float:
    """RULER's string_match_all: the fraction of reference values found in the prediction, case-insensitively."""
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]


def read_haystack(path: str) -> list[str]:
    """Sentences of a haystack file: RULER's PaulGrahamEssays.json ({"text"}), a .jsonl of {"text"}, or text."""
    raw = " ".join(read_file_documents(path))
    sentences = _sentences(raw)
    if len(sentences) < 10:
        raise ValueError(f"{path}: too little text for a haystack ({len(sentences)} sentences)")
    return sentences


def default_haystack() -> str | None:
    return data_file("ruler", "PaulGrahamEssays.json")


# Pieces of the tasks --------------------------------------------------------------------------------------------

def _key(rng) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _distinct_keys(rng, count: int) -> list[str]:
    pairs = rng.choice(len(_ADJECTIVES) * len(_NOUNS), count, replace=False)
    return [f"{_ADJECTIVES[i // len(_NOUNS)]}-{_NOUNS[i % len(_NOUNS)]}" for i in pairs]


def _uuid(rng) -> str:
    return str(uuid.UUID(int=int(rng.integers(0, 2**63)) << 64 | int(rng.integers(0, 2**63))))


def _number(rng) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _niah_prompt(context: str, kind: str, query: str, answers: int) -> str:
    """RULER's question; in the singular when one value is asked."""
    if answers == 1:
        one = kind[:-1]  # "number", "uuid"
        return ONE_TEMPLATE.format(kind=one, context=context, key=query) + ONE_ANSWER_PREFIX.format(kind=one, key=query)
    return TEMPLATE.format(kind=kind, context=context, key=query) + ANSWER_PREFIX.format(kind=kind, key=query)


def _insert_in_text(words: list[str], needles, depths) -> str:
    """The words with each needle at the sentence boundary nearest to its depth (depths ascending)."""
    n = len(words)
    boundaries = [0] + [i + 1 for i, w in enumerate(words) if w.endswith((".", "!", "?"))] + [n]
    parts, last = [], 0
    for needle, depth in zip(needles, depths):
        at = min(boundaries, key=lambda b: abs(b - depth * n))
        parts += words[last:at] + [needle]
        last = at
    return " ".join(parts + words[last:])


def _insert_lines(lines: list[str], statements, fractions) -> list[str]:
    """The lines with the statements inserted as lines of their own, in order, at `fractions` (ascending)."""
    out = list(lines)
    for offset, (statement, fraction) in enumerate(zip(statements, fractions)):
        out.insert(round(fraction * len(lines)) + offset, statement)
    return out


def _noise_lines(n: int) -> list[str]:
    """The noise paragraph once a line, n words in all (the last line cut short)."""
    words = NOISE.split()
    full, rest = divmod(n, len(words))
    return [NOISE] * full + ([" ".join(words[:rest])] if rest else [])


def _names(rng, count: int, letters: int, alphabet: str = string.ascii_uppercase) -> list[str]:
    """`count` distinct random strings of `letters` letters."""
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(list(alphabet), letters))
        if name not in names:
            names.append(name)
    return names


def _chain(names: list[str], value: str) -> list[str]:
    return [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in itertools.pairwise(names)]


def _numbered(words) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _shuffled(items: list, seed: int) -> list:
    return [items[i] for i in np.random.default_rng(seed).permutation(len(items))]


class Generator:
    """Builds RULER samples of a given token length for one tokenizer."""

    def __init__(self, tokenizer, haystack: str | None = None):
        self.tokenizer = tokenizer
        self.haystack_path = haystack or default_haystack()
        self._essay_words = None

    def _count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _text_words(self, task: str, n: int) -> list[str]:
        """The first n words of the task's text haystack (the noise paragraph or the essays), cycled."""
        if task == "niah_single_1":
            source = NOISE.split()
        else:
            if self._essay_words is None:
                if self.haystack_path is None:
                    raise ValueError(f"{task} needs a haystack text: pass --haystack FILE (e.g. RULER's "
                                     "PaulGrahamEssays.json) or set LINJAX_DATA_DIR")
                self._essay_words = " ".join(read_haystack(self.haystack_path)).split()
            source = self._essay_words
        return (source * (n // len(source) + 1))[:n]

    def _fit(self, build, length: int, task: str, smallest: int = 1, largest: int | None = None,
             unit: str = "filler items") -> int:
        """The most filler units n ≥ `smallest` whose prompt build(n) has at most `length` tokens."""
        fits = lambda n: self._count(build(n)) <= length
        if not fits(smallest):
            raise ValueError(f"{length} tokens cannot hold even the smallest {task} prompt "
                             f"({self._count(build(smallest))} tokens); ask for a longer length")
        low, high = smallest, 2 * smallest
        while fits(high):
            if largest is not None and high >= largest:
                raise ValueError(f"{task} at {length} tokens needs more than the {largest} {unit} it has; "
                                 "ask for a shorter length")
            low, high = high, high * 2 if largest is None else min(high * 2, largest)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low

    def sample(self, task: str, length: int, rng: np.random.Generator, depth: float | None = None) -> Sample:
        """One sample of `task` whose prompt has `length` tokens (±2%). `depth` places niah_single_*'s needle."""
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
        if depth is not None and not task.startswith("niah_single"):
            raise ValueError(f"depth= places the needle of niah_single_*; {task} draws its own positions")
        if task.startswith("niah_single"):
            return self._single(task, length, rng, depth)
        if task in ("multikey", "multivalue", "multiquery"):
            return self._multi(task, length, rng)
        return {"multikey_2": self._distractors, "multikey_3": self._distractors, "vt": self._vt, "cwe": self._cwe,
                "fwe": self._fwe}[task](task, length, rng)

    def _single(self, task, length, rng, depth) -> Sample:
        kind = "uuids" if task == "niah_single_3" else "numbers"
        key = _key(rng)
        value = _uuid(rng) if kind == "uuids" else _number(rng)
        needle = _needle(kind, key, value)
        depth = float(rng.choice(DEPTHS)) if depth is None else depth
        build = lambda n: _niah_prompt(_insert_in_text(self._text_words(task, n), [needle], [depth]),
                                       kind, key, 1)
        return Sample(task, build(self._fit(build, length, task)), (value,), NEW_TOKENS[task], (needle,), (depth,))

    def _multi(self, task, length, rng) -> Sample:
        """Essay haystack with 4 needles: 4 keys (one or all asked), or one key with 4 values."""
        if task == "multivalue":
            keys = _distinct_keys(rng, 1)
            values = {keys[0]: [_number(rng) for _ in range(4)]}
        else:
            keys = _distinct_keys(rng, 4)
            values = {key: [_number(rng)] for key in keys}
        needles = [_needle("numbers", key, v) for key in keys for v in values[key]]
        needles = [needles[i] for i in rng.permutation(len(needles))]
        depths = tuple(float(d) for d in np.sort(rng.choice(DEPTHS, len(needles), replace=False)))
        asked = [keys[i] for i in rng.permutation(4)] if task == "multiquery" else [keys[rng.integers(len(keys))]]
        answers = tuple(v for key in asked for v in values[key])
        query = ", ".join(asked[:-1]) + ", and " + asked[-1] if len(asked) > 1 else asked[0]
        build = lambda n: _niah_prompt(_insert_in_text(self._text_words(task, n), needles, depths),
                                       "numbers", query, len(answers))
        return Sample(task, build(self._fit(build, length, task)), answers, NEW_TOKENS[task], tuple(needles), depths)

    def _distractors(self, task, length, rng) -> Sample:
        """A haystack of needles with other keys, one a line, and the asked needle among them."""
        new_key = _uuid if task == "multikey_3" else _key
        kind = "uuids" if task == "multikey_3" else "numbers"
        new_value = _uuid if task == "multikey_3" else _number
        key, value = new_key(rng), new_value(rng)
        needle = _needle(kind, key, value)
        depth = float(rng.choice(DEPTHS))
        lines, other = [], np.random.default_rng(int(rng.integers(2**63)))

        def build(n):
            while len(lines) < n:  # the same first lines for every n
                k = new_key(other)
                if k != key:
                    lines.append(_needle(kind, k, new_value(other)))
            context = "\n".join(_insert_lines(lines[:n], [needle], [depth]))
            return _niah_prompt(context, kind, key, 1)

        return Sample(task, build(self._fit(build, length, task)), (value,), NEW_TOKENS[task], (needle,), (depth,))

    def _vt(self, task, length, rng) -> Sample:
        """After a worked example, a chain of 4 hops hidden among noise lines; answer: the 5 names."""
        names, value = _names(rng, 5, letters=5), str(int(rng.integers(10000, 100000)))
        chain = _chain(names, value)
        fractions = tuple(float(f) for f in np.sort(rng.random(len(chain))))
        # RULER's worked example: 3-letter names, its own value, the answer written out.
        shown, shown_value = _names(rng, 5, letters=3), str(int(rng.integers(10000, 100000)))
        while shown_value == value:
            shown_value = str(int(rng.integers(10000, 100000)))
        context = "\n".join(_insert_lines(_noise_lines(3 * len(NOISE.split())), _chain(shown, shown_value),
                                          np.sort(rng.random(len(chain)))))
        example = (VT_TEMPLATE.format(context=context, value=shown_value)
                   + VT_ANSWER_PREFIX.format(count=len(shown), value=shown_value) + " ".join(shown) + "\n")

        def build(n):
            context = "\n".join(_insert_lines(_noise_lines(n), chain, fractions))
            return (example + VT_TEMPLATE.format(context=context, value=value)
                    + VT_ANSWER_PREFIX.format(count=len(names), value=value))

        return Sample(task, build(self._fit(build, length, task)), tuple(names), NEW_TOKENS[task], tuple(chain),
                      fractions)

    def _cwe(self, task, length, rng) -> Sample:
        """After a worked example, a numbered list: 10 words often, n others rarely; answer: the 10."""
        long = length >= 4096  # RULER's two settings
        often, rarely = (30, 3) if long else (6, 1)
        shown = [str(w) for w in rng.choice(WORDS, 40 if long else 20, replace=False)]
        shown_list = shown[:10] * (10 if long else 3) + shown[10:] * (3 if long else 1)
        example = (CWE_TEMPLATE.format(context=_numbered(_shuffled(shown_list, int(rng.integers(2**63)))))
                   + CWE_ANSWER_PREFIX + " " + _numbered(shown[:10]) + "\n")
        order = [str(w) for w in rng.permutation(WORDS)]
        seed = int(rng.integers(2**63))
        words = lambda n: _shuffled(order[:10] * often + order[10:10 + n] * rarely, seed)
        build = lambda n: example + CWE_TEMPLATE.format(context=_numbered(words(n))) + CWE_ANSWER_PREFIX
        n = self._fit(build, length, task, largest=len(order) - 10, unit="rare words (eval/ruler_words.py)")
        return Sample(task, build(n), tuple(order[:10]), NEW_TOKENS[task], words=tuple(words(n)))

    def _fwe(self, task, length, rng) -> Sample:
        """Coded words with Zipf counts (alpha 2) in n draws; "..." ranks first; answer: ranks 2 to 4."""
        size = max(5, (length - NEW_TOKENS[task]) // 50)
        vocab = ["..."] + _names(rng, size - 1, letters=6, alphabet=string.ascii_lowercase)
        expected = np.arange(1, size + 1) ** -2.0 / (math.pi ** 2 / 6)  # k^-alpha / zeta(alpha), alpha = 2
        seed = int(rng.integers(2**63))
        words = lambda n: _shuffled([w for w, c in zip(vocab, (n * expected).astype(int)) for _ in range(c)],
                                    seed)
        build = lambda n: FWE_TEMPLATE.format(context=" ".join(words(n))) + FWE_ANSWER_PREFIX
        # From 80 draws on, ranks 2 to 5 have distinct counts (n/(k^2 zeta(2)) differ by at least one).
        n = self._fit(build, length, task, smallest=80)
        return Sample(task, build(n), tuple(vocab[1:4]), NEW_TOKENS[task], words=tuple(words(n)))
