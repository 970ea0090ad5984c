"""More unique training text for the claims rows: about 2,400 C4 web documents (~1M tokens), as one jsonl.

The claims rows train on 0.47M unique tokens (../shared/data's DCLM documents and essays) and fit them:
more passes over them raise the held-out perplexity (results/claims.md). This builds a second text from
two C4 samples committed to public GitHub repositories (C4: the English Common Crawl text of allenai/c4,
licensed ODC-By 1.0, Common Crawl's terms of use apply). The project commits no training text; the file
is written outside the repository (configs/claims/*-c4*.toml read ../extra-text/c4-sample.jsonl).

    python experiments/c4_text.py SAMPLE_JSONL PF_DECODING_JSONL ../extra-text/c4-sample.jsonl

SAMPLE_JSONL: Diffusion-bachelor/diffusion-data-constraint-rare-events @ 3305ae85ae51f4882f291ff894d49946af655a11,
  data/c4_sample.jsonl: the first 1,000 documents of C4 en's c4-train.00000-of-01024 ({text, timestamp, url});
  sha256 cdd5b754119131d2934e3e799a059a9d64f53a6aac9e7e2ef79b43120bb01a32.
PF_DECODING_JSONL: XuandongZhao/pf-decoding @ dbcef09aa9dcba08ef3f28166c5e54f279a2672d, data/c4.jsonl
  (MIT): 1,480 C4 documents cut into a ~400-character prefix and a ~200-token completion, rejoined here;
  sha256 127931c106789c5dee6a803d57e08fe8f689546ca5e7f35735e1a2c3aa567f6b.
The output: 2,399 documents, 3,932,212 characters,
  sha256 1648def4d050c10500fb4eb773f476c9463cd677764cc6fef993108696fd0b85.

Dropped: documents under 200 characters, exact repeats (of each other or of the DCLM documents), pages
with under 12% common English words (keyword spam, lists, other languages), and copied Wikipedia pages
(the evaluation text is Wikipedia's).
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys

from linjax.files import write_text

DCLM = ["../shared/data/webtext/dclm_majority_data.jsonl", "../shared/data/webtext/dclm_agreement_data.jsonl"]
COMMON = frozenset({"the", "of", "and", "to", "a", "in", "is", "that", "for", "it", "on", "with", "as", "was", "be",
                   "by", "this", "are", "at", "from", "or", "an", "have", "you", "not", "but", "his", "they", "we",
                   "your", "can", "all", "has", "their", "were", "will", "more", "one", "which", "its", "our", "if",
                   "about", "would", "been", "so", "what", "there", "when"})


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def rejoin(prefix: str, completion: str, vocabulary: collections.Counter) -> str:
    """prefix + completion, with the space the cut removed put back where the two ends are whole words.

    The cut fell between tokens, so it may split a word ("bi|ology") or drop a space ("pun|intended");
    the text's own vocabulary decides which."""
    if not (prefix and completion) or prefix[-1].isspace() or completion[0].isspace():
        return prefix + completion
    left, right = re.search(r"[A-Za-z]*$", prefix).group(0), re.match(r"[A-Za-z]*", completion).group(0)
    if left and right:
        a, b = left.lower(), right.lower()
        joined_seen, both_words = vocabulary[a + b] > 0, vocabulary[a] > 2 and vocabulary[b] > 2
        if both_words and (not joined_seen or vocabulary[a + b] < 3):
            return prefix + " " + completion
        return prefix + completion
    if (prefix[-1].isalnum() and completion[0].isalnum()) or (prefix[-1] in ",.;:!?)]\"" and completion[0].isalnum()):
        return prefix + " " + completion
    return prefix + completion


def kept(texts, seen: set) -> list[str]:
    """The documents that pass the filters of the module's docstring; `seen` (normalised texts) grows."""
    out = []
    for text in (t.strip() for t in texts):
        key = " ".join(text.split())
        words = re.findall(r"[a-z']+", text.lower())
        if (len(text) < 200 or key in seen or sum(w in COMMON for w in words) < 0.12 * max(1, len(words))
                or "- Wikipedia" in text or "From Wikipedia, the free encyclopedia" in text):
            continue
        seen.add(key)
        out.append(text)
    return out


def build(sample_path: str, pf_path: str, dclm_paths=DCLM) -> list[str]:
    sample = [r["text"] for r in read_jsonl(sample_path)]
    pieces = [(r["prefix"], r["gold_completion"]) for r in read_jsonl(pf_path)]
    dclm = [r["text"] for path in dclm_paths for r in read_jsonl(path)]
    vocabulary = collections.Counter(w.lower() for t in sample + dclm + [f"{p} {c}" for p, c in pieces]
                                     for w in re.findall(r"[A-Za-z]+", t))
    seen = {" ".join(t.split()) for t in dclm}
    return kept(sample, seen) + kept([rejoin(p, c, vocabulary) for p, c in pieces], seen)


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: python experiments/c4_text.py SAMPLE_JSONL PF_DECODING_JSONL OUT_JSONL")
    if os.path.exists(argv[2]):
        sys.exit(f"{argv[2]} exists; give a new path (this never overwrites a file)")
    documents = build(argv[0], argv[1])
    write_text(argv[2], "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in documents))
    print(f"{argv[2]}: {len(documents)} documents, {sum(map(len, documents)):,} characters")


if __name__ == "__main__":
    main(sys.argv[1:])
