"""The claims machinery (experiments/claims*.py, stats.py): the paired bootstrap over articles, the seed-aware
verdicts, the rows' data, running them, and the report."""

import math
import os

import numpy as np
import pytest

from experiments import claims_data, claims_report, claims_run, stats
from tests.helpers import stopping_at_call

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def scored_rows(per_token_difference, seed=0, articles=60, windows_per_article=5, tokens=1023):
    """Two rows' per-window results on the same windows: articles differ a lot in difficulty (shared by
    both rows), each row adds its own noise per window, and row a is `per_token_difference` nats per
    token above row b on average."""
    rng = np.random.default_rng(seed)
    article = np.repeat(np.arange(articles), windows_per_article)
    difficulty = rng.uniform(2.5, 4.5, articles)[article]
    b = (difficulty + rng.normal(0, 0.05, article.size)) * tokens
    a = b + (per_token_difference + rng.normal(0, 0.05, articles)[article]) * tokens
    counts = [tokens] * article.size
    return ({"article": article.tolist(), "nll": a.tolist(), "tokens": counts},
            {"article": article.tolist(), "nll": b.tolist(), "tokens": counts})


def test_a_known_difference_holds_when_it_also_exceeds_the_seed_spread():
    better, worse = scored_rows(-0.1)
    interval = stats.paired_bootstrap(better, worse)
    point, low, high = interval
    assert low < point < high < 0 and low < -0.1 < high
    assert stats.seed_aware_verdict(interval, point, 0.02) == "holds"
    reversed_interval = stats.paired_bootstrap(worse, better)
    assert stats.seed_aware_verdict(reversed_interval, -point, 0.02) == "does not hold"
    # the same text interval, but a difference inside the training-seed spread: not decided by one seed each
    assert stats.seed_aware_verdict(interval, point, 0.2).startswith("undecided (|Δ| 0.1")
    # the seeds' means point the other way from seed 1's interval
    assert stats.seed_aware_verdict(interval, 0.05, 0.02) == "undecided (the interval and the seeds disagree)"


def test_no_difference_is_undecided():
    better, worse = scored_rows(0.0, seed=1)
    point, low, high = stats.paired_bootstrap(better, worse)
    assert low < 0 < high
    assert stats.seed_aware_verdict((point, low, high), -0.5, 0.01) == "undecided (interval spans 0)"


def test_the_bootstrap_is_paired_and_seeded():
    better, worse = scored_rows(-0.01, seed=2)
    first = stats.paired_bootstrap(better, worse)
    assert stats.paired_bootstrap(better, worse) == first  # a fixed seed: the same interval every time
    # The articles' shared difficulty cancels in the pairing: the interval is far narrower than the
    # spread of either row's per-article perplexity.
    assert first[2] - first[1] < 0.05


def test_rows_without_per_window_results_or_on_other_windows_are_not_compared():
    assert stats.seed_aware_verdict(None, -1.0, 0.01) == "undecided (no per-window results)"
    better, worse = scored_rows(-0.1)
    with pytest.raises(ValueError, match="same windows"):
        stats.paired_bootstrap(better, {**worse, "tokens": worse["tokens"][:-1]})


def test_the_seed_spread_to_exceed_is_two_standard_errors_of_a_difference_of_means():
    assert stats.seed_threshold(0.0063, 1, 1) == pytest.approx(2 * math.sqrt(2) * 0.0063)
    assert stats.seed_threshold(0.0063, 3, 3) == pytest.approx(2 * 0.0063 * math.sqrt(2 / 3))
    assert stats.seed_threshold(0.0063, 3, None) == pytest.approx(2 * 0.0063 / math.sqrt(3))  # an untrained side
    assert stats.seed_threshold(0.0063, None, None) == 0
    # pooled over groups of seeds: each group's squared deviations from its own mean, over its n - 1
    groups = [[1.0, 1.1, 1.2], [2.0, 2.2], [5.0]]
    expected = math.sqrt((0.02 + 0.02) / (2 + 1))
    assert stats.pooled_sd(groups) == pytest.approx(expected)
    assert stats.pooled_sd([[1.0], []]) is None


def test_the_committed_seeds_pool_to_the_audited_spread():
    """The five configurations of the recipe trained with three seeds: their per-run SD of whole-file
    log-perplexity pools to about 0.0063, so one seed against one must differ by about 0.018."""
    groups = [[claims_data.whole_file_log_ppl(r) for r in claims_data.seed_groups()[c]]
              for c in claims_data.SEED_SPREAD]
    if any(v is None for g in groups for v in g):
        pytest.skip("a seed of the pooled configurations is not scored on the whole file")
    sd = stats.pooled_sd(groups)
    assert sd == pytest.approx(0.0063, abs=0.0003)
    assert stats.seed_threshold(sd, 1, 1) == pytest.approx(0.018, abs=0.001)


def test_mcnemar_exact_p_values():
    assert stats.mcnemar_exact(5, 1) == pytest.approx(0.21875)  # 2 · (1 + 6) / 64
    assert stats.mcnemar_exact(0, 0) == 1.0 and stats.mcnemar_exact(3, 3) == 1.0
    assert stats.mcnemar_exact(10, 0) == pytest.approx(2 / 1024)
    with pytest.raises(ValueError, match="≥ 0"):
        stats.mcnemar_exact(-1, 2)


def test_wilson_interval_stays_inside_zero_and_one():
    low, high = stats.wilson_interval(0.0, 20)
    assert low == 0.0 and 0.1 < high < 0.2
    low, high = stats.wilson_interval(1.0, 20)
    assert high == 1.0 and 0.8 < low < 0.9


def lambada_examples(correct):
    return [{"loglikelihood": -1.0, "greedy": bool(c), "target_tokens": 1} for c in correct]


def test_the_lambada_accuracy_difference_is_paired_over_examples():
    rng = np.random.default_rng(4)
    worse = rng.random(2000) < 0.3
    better = worse | (rng.random(2000) < 0.1)  # right wherever `worse` is, and on about 7% more
    point, low, high = stats.paired_accuracy_bootstrap(lambada_examples(better), lambada_examples(worse))
    assert point == pytest.approx(100 * (better.mean() - worse.mean()))
    assert 0 < low < point < high
    # Paired: the examples both get right or both get wrong cancel, so the interval is far narrower
    # than an unpaired one for two accuracies near 30% on 2,000 examples (about ±2.8 points).
    assert high - low < 2.5
    swapped = stats.paired_accuracy_bootstrap(lambada_examples(worse), lambada_examples(better))
    assert swapped[1] < swapped[2] < 0
    same = stats.paired_accuracy_bootstrap(lambada_examples(worse), lambada_examples(worse))
    assert same == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same LAMBADA examples"):
        stats.paired_accuracy_bootstrap(lambada_examples(better), lambada_examples(worse[:-1]))


def test_the_share_of_the_gap_closed_on_both_scales():
    row, window = scored_rows(-0.3, seed=3)  # row: 0.3 nats per token below window-only, article by article
    original, _ = scored_rows(-0.6, seed=3)  # the original: twice as far below
    original = {**original, "nll": list(np.asarray(window["nll"]) - 2 * (np.asarray(window["nll"]) - row["nll"]))}
    point, low, high = stats.gap_closed(row, window, original)
    assert point == pytest.approx(0.5) and low <= 0.5 <= high and high - low < 1e-9  # exactly half, in every draw
    # halfway in log-perplexity is the geometric mean of the two perplexities: more than half the perplexity gap
    ppl_point, ppl_low, ppl_high = stats.gap_closed(row, window, original, scale="ppl")
    w, o = stats.log_ppl(window), stats.log_ppl(original)
    assert ppl_point == pytest.approx((math.exp(w) - math.exp((w + o) / 2)) / (math.exp(w) - math.exp(o)))
    assert ppl_point > 0.5 and ppl_low <= ppl_point <= ppl_high
    point, low, high = stats.gap_closed(window, window, original)
    assert point == 0 and low == high == 0
    with pytest.raises(ValueError, match="same windows"):
        stats.gap_closed(row, window, {**original, "article": original["article"][::-1]})
    with pytest.raises(ValueError, match="scale"):
        stats.gap_closed(row, window, original, scale="percent")


def test_what_a_lever_adds_to_the_share_is_the_difference_of_the_two_shares_resampled_jointly():
    with_lever, window = scored_rows(-0.3, seed=5)  # 0.3 nats per token below window-only
    without_lever = {**with_lever, "nll": list(np.asarray(window["nll"]) - 0.1 * np.asarray(window["tokens"]))}
    original = {**window, "nll": list(np.asarray(window["nll"]) - 0.6 * np.asarray(window["tokens"]))}
    point, low, high = stats.gap_share_difference(with_lever, without_lever, window, original)
    assert point == pytest.approx(stats.gap_closed(with_lever, window, original)[0]
                                  - stats.gap_closed(without_lever, window, original)[0])
    assert point == pytest.approx(1 / 3, abs=0.02) and low < point < high and high - low < 0.2
    # paired: the shares' own intervals are far wider than their difference's, the articles' difficulty cancels
    assert high - low < np.ptp(stats.gap_closed(with_lever, window, original)[1:])
    assert stats.gap_share_difference(with_lever, with_lever, window, original) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same windows"):
        stats.gap_share_difference(with_lever, {**without_lever, "tokens": without_lever["tokens"][::-1][:-1] + [1]},
                                   window, original)


def test_the_training_length_section_compares_the_same_text_at_both_lengths(monkeypatch):
    better_512, window_512 = scored_rows(-0.1, articles=25)
    better_1024, window_1024 = scored_rows(-0.2, articles=25, seed=4)
    files = {("gdn-w56-s8", "wikitext2-512"): better_512, ("window-w56-s8", "wikitext2-512"): window_512,
             ("gdn-w56-s8", "wikitext2-full"): better_1024, ("window-w56-s8", "wikitext2-full"): window_1024}
    monkeypatch.setattr(claims_data, "per_window",
                        lambda row, evaluation="wikitext2-full": files.get((row, evaluation)))
    metrics = {row: {"ppl": 30.0, "ppl_512": 32.0} for row in claims_data.ROWS}
    line = next(line for line in claims_report.training_length_lines(metrics) if line.startswith("| gdn-w56-s8 |"))
    at_512, at_1024 = (float(cell.split()[0]) for cell in line.split(" | ")[3:5])
    assert at_512 == pytest.approx(-0.1, abs=0.03) and at_1024 == pytest.approx(-0.2, abs=0.03)
    assert "64 windows in" in line  # the 1,024-token side: the first 64 windows, the same text as the 128 of 512
    monkeypatch.setattr(claims_data, "per_window", lambda row, evaluation="wikitext2-full": None)
    assert "Not yet measured" in claims_report.training_length_lines(metrics)[-1]


def test_the_report_of_the_committed_rows(monkeypatch, tmp_path):
    """`report` on the committed rows (written to a string here, not to claims.md): every claim has a
    seed-aware verdict, a LAMBADA interval exactly where both rows scored all of LAMBADA, and the header
    states the facts an audit found missing; every share of the gap says its scale."""
    written = {}
    monkeypatch.setattr(claims_report, "write_text", lambda path, text: written.setdefault("text", text) and path)
    monkeypatch.setattr(claims_report, "SCALING_PLOT", str(tmp_path / "scaling.png"))
    claims_report.report(readme=None)
    text = written["text"]
    assert "10M tokens (2,500 steps x 4,096)" in text and "20M" not in text
    assert "SmolLM2-135M-Instruct dequantised from the Q4_1 GGUF" in text
    assert "| 1,000 + 1,000 | 1 then 2 |" in text  # the two-stage row's steps and seeds
    assert "3 + 1" not in text and "holds across" not in text  # the old rule is gone
    for claim, _, better, worse in claims_data.CLAIMS:
        line = next(line for line in text.splitlines() if line.startswith(f"| {claim} |"))
        verdict, lambada = line.strip("| ").split(" | ")[-2:]
        assert verdict.split(" (")[0] in ("holds", "does not hold", "undecided"), line
        both_scored = all(claims_data.metrics_of(row)["lambada_examples"] for row in (better, worse))
        assert (lambada != "—") == both_scored
    assert "log scale" in text and "perplexity scale" in text
    for lever, with_row, without_row in claims_data.LEVERS:  # every lever, with the claims' verdict on its pair
        line = next(line for line in text.splitlines() if line.startswith(f"| {lever} | {with_row} vs {without_row}"))
        assert line.strip("| ").split(" | ")[-1].split(" (")[0] in ("helps", "hurts", "undecided"), line


def test_the_rows_file_names_only_rows_it_defines(tmp_path):
    (tmp_path / "claims.toml").write_text('[rows.a]\nwhat = "a row"\n\n[[claims]]\nclaim = "a beats b"\n'
                                          'better = "a"\nworse = "b"\n')
    with pytest.raises(ValueError, match="b named but not defined under"):
        claims_data.read_claims_file(str(tmp_path / "claims.toml"))
    (tmp_path / "claims.toml").write_text('[rows.a]\nwhat = "a row"\n\n[[levers]]\nlever = "c"\nwith = "a"\n'
                                          'without = "c"\n')
    with pytest.raises(ValueError, match="c named but not defined under"):
        claims_data.read_claims_file(str(tmp_path / "claims.toml"))
    (tmp_path / "claims.toml").write_text('[rows.a]\nwhat = "a row"\nmodel = "smollm2-135m"\n')
    read = claims_data.read_claims_file(str(tmp_path / "claims.toml"))
    assert read["rows"] == {"a": "a row"} and read["untrained"] == {"a": "smollm2-135m"} and read["claims"] == []


def test_the_readme_block_replaces_only_what_lies_between_its_markers(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# linjax\n\nintro\n")
    assert not claims_report.write_readme_block("| a | b |", str(readme))
    assert "has no results markers" in capsys.readouterr().out and readme.read_text() == "# linjax\n\nintro\n"
    readme.write_text(f"intro\n{claims_report.README_START}\nold figures\n{claims_report.README_END}\noutro\n")
    assert claims_report.write_readme_block("| a | b |\n\nthree sentences.", str(readme))
    assert readme.read_text() == (f"intro\n{claims_report.README_START}\n| a | b |\n\nthree sentences.\n"
                                  f"{claims_report.README_END}\noutro\n")
    claims_report.write_readme_block("| a | b |\n\nthree sentences.", str(readme))  # again: the same file
    assert readme.read_text().count(claims_report.README_START) == 1


def test_the_readme_block_of_the_committed_rows():
    metrics = {row: claims_data.metrics_of(row) for row in claims_data.ROWS}
    windows = {row: claims_data.per_window(row) for row in claims_data.ROWS}
    block = claims_report.readme_block(metrics, windows, claims_report.gap_shares(windows))
    table = [line for line in block.splitlines() if line.startswith("|")]
    prose = " ".join(line for line in block.splitlines() if line and not line.startswith("|"))
    assert len(table) <= 12 and prose.count(". ") == 2  # a short table, three sentences
    assert "log scale" in prose and "`original`" in table[2] and "results/claims.md" in prose
    assert all(len(line) <= 100 for line in block.splitlines() if not line.startswith("|"))


def test_the_lolcats_peer_is_two_stages_of_the_claims_budget(monkeypatch):
    """configs/claims/lolcats-at.toml then lolcats.toml: Hedgehog + window 64 (no sinks) under one
    normaliser; stage 1 trains the feature maps by attention transfer, stage 2 LoRA alone (rank 8 on
    q/k/v/o) with CE from stage 1's run; 1,000 + 1,000 steps x 512 tokens on the claims rows' data.
    Both build, the report lists the row and its claim, and a row not yet trained shows as such."""
    import linjax
    from linjax.convert.sources import source_hf_config
    from linjax.experiment import load_experiment
    from tests.helpers import missing

    transfer, ce = (load_experiment(os.path.join(ROOT, "configs", "claims", f"{name}.toml"))
                    for name in ("lolcats-at", "lolcats"))
    settings = ce.linearize
    assert (settings.mechanism, settings.window, settings.sinks, settings.combine) == ("hedgehog", 64, 0, "sum")
    assert (settings.adapter, settings.lora_rank, settings.output_gain, settings.output_gain_init) == (
        "lora", 8, True, 10.0)  # LoLCATs' window factor starts at 0.1: a gain of 10
    assert transfer.linearize == settings  # train.init_from needs the same [linearize] settings
    assert (transfer.train.objective, transfer.train.trainable) == ("attention_transfer", "mechanism")
    assert (ce.train.objective, ce.train.trainable, ce.train.init_from) == ("ce", "adapter", transfer.run_dir)
    row = load_experiment(os.path.join(ROOT, "configs", "claims", "gdn-w56-s8-shortconv-at-ce.toml"))
    assert transfer.data == ce.data == row.data and transfer.model == ce.model == row.model
    assert claims_data.stages("lolcats") == [("lolcats-at", 1000, 512, 1), ("lolcats", 1000, 512, 2)]
    assert "lolcats" in claims_data.ROWS and "liger-gla" in claims_data.ROWS
    assert {"lolcats", "liger-gla"} <= {worse for *_, worse in claims_data.CLAIMS}
    try:
        hf_config = source_hf_config(ce.model.source)
    except FileNotFoundError as err:
        missing(str(err))
    model = linjax.abstract_model(hf_config, settings)
    assert linjax.trainable_parameter_count(model) > 0

    monkeypatch.setattr(claims_data, "training_state", lambda row: (0, False))  # as on a checkout with no runs
    trained, seeds, tokens, _ = claims_report.training_columns("lolcats", None)
    assert (trained, seeds, tokens) == ("not started + not started", "1 then 2", "0.00M")


def test_replicates_and_the_control_differ_from_their_rows_only_where_named():
    """Each seed replicate's config is its row's with another seed (and, for a second stage, its own first
    stage); the CE -> CE control is attention transfer -> CE with the first stage's objective changed."""
    def settings(row):
        config = claims_data.config_of(row)
        train = {k: v for k, v in config["train"].items() if k not in ("seed", "init_from", "objective")}
        return config["model"], config["linearize"], config["data"], train

    replicates = [row for row in claims_data.ROWS if "-seed" in row]
    assert len(replicates) == 2 * len(claims_data.seed_groups())  # seeds 2 and 3 of each row with seeds
    for row in replicates:
        base, seed = row.rsplit("-seed", 1)
        assert settings(row) == settings(base), row
        assert claims_data.config_of(row)["run_dir"] == f"results/runs/{row}"
        stages = [(os.path.basename(name), seed_of) for name, _, _, seed_of in claims_data.stages(row)]
        base_stages = claims_data.stages(base)
        assert len(stages) == len(base_stages) and stages[-1][0] == row and stages[0][1] == int(seed)
        for (name, _), (base_name, *_) in zip(stages, base_stages):
            assert claims_data.config_of(name)["train"].get("objective", "ce") == \
                claims_data.config_of(base_name)["train"].get("objective", "ce")
    control = claims_data.stages("gdn-w56-s8-shortconv-ce-ce")
    treated = claims_data.stages("gdn-w56-s8-shortconv-at-ce")
    assert [stage[1:] for stage in control] == [stage[1:] for stage in treated]  # steps, tokens, seeds
    assert [settings(stage[0]) for stage in control] == [settings(stage[0]) for stage in treated]
    assert [claims_data.config_of(stage[0])["train"]["objective"] for stage in control] == ["ce", "ce"]
    assert [claims_data.config_of(stage[0])["train"]["objective"] for stage in treated] == ["attention_transfer", "ce"]


def test_paired_scoring_goes_on_from_where_it_stopped(monkeypatch, tmp_path, tiny_source, tokenizer):
    """`evaluate-paired` scores rows window by window, writes per-window results after each window, and a
    rerun after a stop goes on from them to the results an uninterrupted run gives."""
    import json

    import linjax.eval.perplexity as perplexity

    text = "".join(f" = Article {k} = \n" + f" Sentence {k} of the article about topic {k} .\n" * 3
                   for k in range(3))
    (tmp_path / "text.txt").write_text(text)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(claims_data, "SEQ_LEN", 32)
    assert len(ids) > 2 * 32 and len(ids) % 32 >= 2  # full windows and a shorter last one
    monkeypatch.setattr(claims_data, "WIKITEXT", str(tmp_path / "text.txt"))
    monkeypatch.setattr(claims_data, "ROWS", {"first": "a row", "second": "the same model again"})
    monkeypatch.setattr(claims_data, "model_argument", lambda row: tiny_source)

    def scored(directory, row):
        return json.loads((tmp_path / directory / row / "wikitext2-full.windows.json").read_text())

    monkeypatch.setattr(claims_data, "eval_dir", lambda row: str(tmp_path / "whole" / row))
    claims_run.evaluate_paired(["first", "second"])
    whole = scored("whole", "second")
    assert whole["complete"] and whole["results"][0]["tokens"] == [31] * (len(ids) // 32) + [len(ids) % 32 - 1]
    assert whole["results"][0]["nll"] == scored("whole", "first")["results"][0]["nll"]  # the same model

    monkeypatch.setattr(claims_data, "eval_dir", lambda row: str(tmp_path / "stopped" / row))
    score = perplexity.window_scores
    monkeypatch.setattr(perplexity, "window_scores", stopping_at_call(3, score, []))  # the third window
    with pytest.raises(KeyboardInterrupt):
        claims_run.evaluate_paired(["first", "second"])
    stopped = scored("stopped", "second")
    assert not stopped["complete"] and len(stopped["results"][0]["nll"]) == 1  # each row: its first window
    assert not (tmp_path / "stopped" / "second" / "wikitext2-full.json").exists()
    monkeypatch.setattr(perplexity, "window_scores", score)
    claims_run.evaluate_paired(["first", "second"])
    for row in ("first", "second"):
        resumed, uninterrupted = scored("stopped", row)["results"][0], scored("whole", row)["results"][0]
        assert resumed["tokens"] == uninterrupted["tokens"] and resumed["article"] == uninterrupted["article"]
        for key in ("nll", "position_nll"):
            np.testing.assert_allclose(resumed[key], uninterrupted[key], rtol=1e-6)
    summary = json.loads((tmp_path / "stopped" / "second" / "wikitext2-full.json").read_text())["results"][0]
    assert summary["tokens"] == len(ids) - len(whole["results"][0]["tokens"])


def test_an_unknown_evaluation_name_is_refused_in_one_line():
    with pytest.raises(SystemExit, match="unknown evaluation perplexity-521; choose from perplexity, perplexity-512"):
        claims_run.evaluate(["window-64"], {"perplexity-521"})


def test_each_variant_row_is_its_base_with_the_named_changes_only():
    """The confound and lever rows (claims_data.VARIANTS): each config is its base row's with exactly the named
    settings changed, its own run_dir, and the row listed in ROWS; every variant's base is a row too."""
    for row, (base, changes) in claims_data.VARIANTS.items():
        assert row in claims_data.ROWS and base in claims_data.ROWS, row
        expected = claims_data.config_of(base)
        expected["run_dir"] = f"results/runs/{row}"
        for name, value in changes.items():
            section, key = name.split(".")
            assert expected[section].get(key) != value, f"{row}: {name} is already {value!r} in {base}"
            expected[section][key] = value
        assert claims_data.config_of(row) == expected, row


def test_the_scaling_section_lists_every_point_and_plots_from_two(monkeypatch, tmp_path):
    """The scaling curve's table lists its four rows with tokens and epochs; a row still training says
    at which step; the plot is drawn once two finished rows have a whole-file perplexity, and not before."""
    data = {tuple(claims_data.config_of("gdn-w56-s8")["data"]["paths"]): {"tokens_per_epoch": 655_000,
                                                                          "unique_tokens": 470_000}}
    metrics = {row: {"ppl": None, "ppl_whole_file": None, "lambada_acc": None} for row in claims_data.ROWS}
    monkeypatch.setattr(claims_report, "SCALING_PLOT", str(tmp_path / "scaling.png"))
    state = {"gdn-w56-s8-0.25M": (500, True), "gdn-w56-s8-0.5M": (1000, True), "gdn-w56-s8": (2000, True),
             "gdn-w56-s8-2M": (1234, False)}
    monkeypatch.setattr(claims_data, "training_state", lambda row: state[row])
    metrics["gdn-w56-s8"]["ppl_whole_file"] = 35.7
    lines = claims_report.scaling_lines(metrics, data)
    assert "| gdn-w56-s8-2M | 2.05M (at step 1,234 of 4,000) | 3.13 / 4.36 |" in "\n".join(lines)
    assert "1 of 4 points measured" in lines[-1] and not (tmp_path / "scaling.png").exists()
    metrics["gdn-w56-s8-0.25M"]["ppl_whole_file"] = 39.0
    for row, ppl in (("gdn-w56-s8-seed2", 36.1), ("window-w56-s8", 42.3), ("original", 25.0)):
        metrics[row]["ppl_whole_file"] = ppl  # the other seeds' marks and both reference lines are drawn too
    lines = claims_report.scaling_lines(metrics, data)
    assert (tmp_path / "scaling.png").stat().st_size > 0 and "scaling.png" in lines[-1]


def fake_rows(monkeypatch, fails=()):
    """Rows a, b1, b2 (b1 and b2 both start from stage b0) with a fake `linjax train` that finishes the
    stage it is given unless it is in `fails`; returns the list of (what, name) calls made, in order."""
    stages = {"a": ["a"], "b1": ["b0", "b1"], "b2": ["b0", "b2"]}
    finished, calls = set(), []
    monkeypatch.setattr(claims_data, "ROWS", dict.fromkeys(stages, "a row"))
    monkeypatch.setattr(claims_data, "stages", lambda row: [(stage, 10, 512, 1) for stage in stages[row]])
    monkeypatch.setattr(claims_data, "training_state", lambda row: (None, row in finished))

    def call(command, log):
        what = "train" if "train" in command else "evaluate"
        name = os.path.basename(command[2])[:-len(".toml")] if what == "train" else command[3]
        calls.append((what, name))
        if what == "train" and name not in fails:
            finished.add(name)
        return 1 if name in fails else 0
    monkeypatch.setattr(claims_run, "call", call)
    return calls


def test_run_trains_each_stage_once_then_evaluates_in_chains(monkeypatch, tmp_path, capsys):
    calls = fake_rows(monkeypatch)
    assert claims_run.run_rows(["b2", "a", "b1", "a"], "perplexity", 1, ["model.dtype=float32"], str(tmp_path)) == 0
    # b2 and b1 share stage b0: one chain, in the order asked, b0 trained once
    assert calls == [("train", "b0"), ("train", "b2"), ("evaluate", "b2"), ("train", "b1"), ("evaluate", "b1"),
                     ("train", "a"), ("evaluate", "a")]
    assert sorted(os.listdir(tmp_path)) == ["a.log", "b1.log", "b2.log"]
    assert "b1: trained and evaluated (log: " in capsys.readouterr().out


def test_run_with_no_evaluations_only_trains(monkeypatch, tmp_path, capsys):
    calls = fake_rows(monkeypatch)
    assert claims_run.run_rows(["b1", "a"], "", 1, [], str(tmp_path)) == 0
    assert calls == [("train", "b0"), ("train", "b1"), ("train", "a")]
    assert "a: trained (log: " in capsys.readouterr().out


def test_run_ends_a_chain_at_its_first_failure_and_counts_it(monkeypatch, tmp_path, capsys):
    calls = fake_rows(monkeypatch, fails={"b0"})
    assert claims_run.run_rows(["b1", "b2", "a"], "perplexity", 2, [], str(tmp_path)) == 2
    assert ("train", "a") in calls and ("evaluate", "a") in calls
    assert [name for _, name in calls if name.startswith("b")] == ["b0"]
    out = capsys.readouterr().out
    assert "b1: training b0 exited with 1" in out and "b2: not run: b1 failed" in out


@pytest.mark.parametrize("rows, only, jobs, message", [
    (["c"], "perplexity", 1, "unknown row 'c'; choose from a, b1, b2"),
    (["a"], "perplexity,niah2", 1, "unknown evaluation in --only 'perplexity,niah2'; choose from perplexity"),
    (["a"], "perplexity", 0, "--jobs must be 1 or more; got 0")])
def test_run_refuses_bad_requests_in_one_line(monkeypatch, tmp_path, rows, only, jobs, message):
    calls = fake_rows(monkeypatch)
    with pytest.raises(SystemExit, match=message.replace("(", r"\(")):
        claims_run.run_rows(rows, only, jobs, [], str(tmp_path))
    assert calls == [] and os.listdir(tmp_path) == []


def test_seed_groups():
    groups = claims_data.seed_groups()
    assert groups["gdn-w56-s8-shortconv"] == ["gdn-w56-s8-shortconv", "gdn-w56-s8-shortconv-seed2",
                                              "gdn-w56-s8-shortconv-seed3"]
    assert set(groups) >= {"liger-gla", "lolcats", "gdn-w56-s8", "gla-w56-s8"}
    assert all(claims_data.seed_label(row) == str(seed) for seed, row in enumerate(groups["lolcats"], 1))
    assert set(claims_data.SEED_SPREAD) <= set(groups)


def test_lambada_columns_come_from_the_jax_scorer_where_lm_eval_did_not_run(monkeypatch, tmp_path):
    """A row with only `lambada-full` (all 5,153 in JAX): its LAMBADA columns are the first 1,000 of those
    examples, and the full columns all of them; an incomplete file counts as not evaluated."""
    from linjax.files import write_json

    monkeypatch.setattr(claims_data, "eval_dir", lambda row: str(tmp_path / row))
    examples = [{"loglikelihood": -1.0 if i < 1000 else -3.0, "greedy": i % 4 == 0, "target_tokens": 1}
                for i in range(1200)]
    write_json(str(tmp_path / "done" / "lambada-full.json"), {"complete": True, "acc": 0.25, "perplexity": 3.4,
                                                              "examples": examples})
    write_json(str(tmp_path / "partial" / "lambada-full.json"), {"complete": False, "examples": examples[:10]})
    done, partial = claims_data.metrics_of("done"), claims_data.metrics_of("partial")
    assert done["lambada_acc"] == 25.0 and abs(done["lambada_ppl"] - math.e) < 1e-12
    assert (done["lambada_full_acc"], done["lambada_full_ppl"]) == (25.0, 3.4)
    assert partial["lambada_acc"] is None and partial["lambada_full_acc"] is None


def test_the_rows_trained_on_a_gpu_come_from_their_runs_histories(monkeypatch, tmp_path):
    """A row's devices are read from each stage's config.json history; a start recorded before
    histories named devices is a CPU unless the row is one of the known GPU rows."""
    from linjax.files import write_json

    monkeypatch.setattr(claims_data, "run_dir", lambda row: str(tmp_path / row))
    monkeypatch.setattr(claims_data, "stages", lambda row: [("one", 1, 512, 1), ("two", 1, 512, 1)] if row == "two"
                        else [(row, 1, 512, 1)])
    monkeypatch.setattr(claims_data, "TRAINED_ON_GPU_UNRECORDED", {"old-gpu": "gpu: 1 x NVIDIA H200"})
    gpu = "gpu: 1 x NVIDIA H100 80GB HBM3"
    write_json(str(tmp_path / "one" / "config.json"), {"history": [{"event": "start"}]})  # before devices
    settings = {"model": {"dtype": "float32"}, "linearize": {"kernel": "chunked"}}
    write_json(str(tmp_path / "two" / "config.json"), {**settings, "history": [
        {"event": "start", "device": "cpu"}, {"event": "resume", "device": gpu}]})
    write_json(str(tmp_path / "old-gpu" / "config.json"), {"model": {"dtype": "bfloat16"},
                                                           "linearize": {"kernel": "pallas"},
                                                           "history": [{"event": "start"}]})
    assert claims_report.training_devices("one") == [] and claims_report.training_devices("two") == [gpu]
    assert claims_report.training_devices("old-gpu") == ["gpu: 1 x NVIDIA H200"]
    assert claims_report.training_devices("never-ran") == []
    monkeypatch.setattr(claims_data, "ROWS", {"one": "", "two": "", "old-gpu": ""})
    assert claims_report.gpu_sentence().endswith(f"two ({gpu}; float32, the chunked kernel), old-gpu (gpu: 1 x NVIDIA "
                                          "H200; bfloat16, the pallas kernel); every other row on a CPU.")


def test_epochs_count_each_stages_passes_over_its_own_text():
    """A LoRA stage on a larger text after a first stage on the common one: the passes add up per text;
    a stage whose text is not counted makes the column '—' rather than a figure of the wrong text."""
    first, second = "gdn-w56-s8-shortconv-identity", "gdn-w56-s8-shortconv-identity-lora-c4-1k"
    paths = [tuple(claims_data.config_of(row)["data"]["paths"]) for row in (first, second)]
    assert paths[0] != paths[1]
    texts = {paths[0]: {"tokens_per_epoch": 1_000_000, "unique_tokens": 500_000},
             paths[1]: {"tokens_per_epoch": 2_000_000, "unique_tokens": 1_500_000}}
    assert claims_report.epochs_of([(first, 1_000_000), (second, 500_000)], texts) == "1.25 / 2.33"
    del texts[paths[1]]
    assert claims_report.epochs_of([(first, 1_000_000), (second, 500_000)], texts) == "—"
