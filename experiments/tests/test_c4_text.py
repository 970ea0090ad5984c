"""The extra training text's builder (experiments/c4_text.py): the prefix/completion rejoin and the filters."""

import collections
import json

from experiments import c4_text

PROSE = "The committee met on Tuesday to discuss the budget, and it was agreed that the plan would be " \
        "reviewed again in the spring by all of the members who were there at the time of the vote. It was " \
        "a long meeting. "


def test_a_cut_inside_a_word_is_closed_and_a_cut_between_words_gets_its_space_back():
    vocabulary = collections.Counter({"biology": 5, "bi": 0, "ology": 0, "pun": 9, "intended": 9})
    assert c4_text.rejoin("marine bi", "ology is", vocabulary) == "marine biology is"
    assert c4_text.rejoin("no pun", "intended.", vocabulary) == "no pun intended."
    assert c4_text.rejoin("it ended.", "Then", vocabulary) == "it ended. Then"
    assert c4_text.rejoin("a ", "b", vocabulary) == "a b"


def test_short_repeated_spam_and_wikipedia_pages_are_dropped(tmp_path):
    spam = "cheap shoes buy now best price discount sale outlet " * 10
    sample = tmp_path / "sample.jsonl"
    texts = [PROSE, "Too short.", PROSE + " ", spam, PROSE + "From Wikipedia, the free encyclopedia"]
    sample.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    pieces = tmp_path / "pieces.jsonl"
    cut = PROSE.index(" budget")
    pieces.write_text(json.dumps({"prefix": PROSE[:cut], "gold_completion": PROSE[cut:] + "More."}))
    dclm = tmp_path / "dclm.jsonl"
    dclm.write_text(json.dumps({"text": PROSE[:150] + " something else entirely, and more of it."}))
    assert c4_text.build(str(sample), str(pieces), [str(dclm)]) == [PROSE.strip(), PROSE + "More."]
