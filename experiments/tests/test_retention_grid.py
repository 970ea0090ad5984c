"""experiments/retention.py: the retention S-NIAH grid, its cell names and commands, and the report's verdicts."""

import json
import os
import sys

import pytest

from experiments.tests.helpers import experiment_script
from linjax.app.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture
def grid(tmp_path, monkeypatch):
    """The module, reading and writing its cells under tmp_path."""
    # dataclasses look their module up in sys.modules
    module = experiment_script("retention.py", register=lambda name, m: monkeypatch.setitem(sys.modules, name, m))
    monkeypatch.setattr(module, "CELLS", str(tmp_path / "retention"))
    monkeypatch.setattr(module, "REPORT", str(tmp_path / "retention.md"))
    return module


def write_cell(grid, name, correct, count=20, depths=None, **settings):
    """A cell's JSON as `linjax eval ruler` writes it: `correct` of `count` samples right."""
    cell = next(c for c in grid.grid() if c.name == name)
    depths = depths or [i / max(count - 1, 1) for i in range(count)]
    os.makedirs(grid.CELLS, exist_ok=True)
    with open(cell.path, "w") as f:
        json.dump({"model": grid.VARIANTS[cell.variant][1],
                   "settings": {"retain_score": "recall", **cell.expected_settings(), **settings},
                   "results": [{"task": grid.TASKS[cell.task], "length": cell.length, "variant": "v",
                                "accuracy": correct / count, "samples": count}],
                   "samples": [{"depth": d, "score": float(i < correct)} for i, d in enumerate(depths)]}, f)


def test_wilson_interval_known_values(grid):
    assert grid.wilson_interval(0.0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)
    assert grid.wilson_interval(0.7, 20) == pytest.approx((0.4810, 0.8545), abs=1e-4)
    low, high = grid.wilson_interval(1.0, 20)
    assert high == 1.0 and low == pytest.approx(0.8389, abs=1e-4)  # mirror of 0 of 20
    assert grid.wilson_interval(0.5, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    with pytest.raises(ValueError, match="at least one sample"):
        grid.wilson_interval(0.5, 0)


def test_the_grid_holds_the_issues_cells_and_the_leads_file_names(grid):
    cells = grid.grid()
    names = [c.name for c in cells]
    # 3 tasks x 3 lengths x (6 budgeted variants x 2 budgets + the original once)
    assert len(names) == len(set(names)) == 117
    assert {"final-recall-128-niah1-2048", "window-only-128-niah1-2048", "final-128-niah1-2048",
            "final-keynorm-128-niah1-2048", "original-full-niah3-4096", "final-recall-256-niah2-1024"} <= set(names)
    assert names[:2] == ["final-recall-128-niah1-2048", "window-only-128-niah1-2048"]  # the claim first


@pytest.mark.parametrize("name, model, budget, window_only, retain, score", [
    ("final-recall-128-niah1-2048", "results/runs/gdn-w56-s8-shortconv", [128], False, 64, "recall"),
    ("final-keynorm-256-niah2-4096", "results/runs/gdn-w56-s8-shortconv", [256], False, 192, "key_norm"),
    ("final-256-niah3-1024", "results/runs/gdn-w56-s8-shortconv", [256], False, 0, "recall"),
    ("window-only-128-niah1-1024", "smollm2-135m", [128], True, 0, "recall"),
    ("original-full-niah2-2048", "smollm2-135m", [], False, 0, "recall"),
])
def test_each_cells_command_is_a_valid_ruler_call_with_the_cells_settings(grid, name, model, budget, window_only,
                                                                          retain, score):
    cell = next(c for c in grid.grid() if c.name == name)
    args = build_parser().parse_args(["eval", *cell.arguments()])
    assert (args.model, args.budgets or [], args.window_only, args.retain, args.retain_score) == (
        model, budget, window_only, retain, score)
    assert (args.samples, args.seed, args.tasks, args.lengths, args.sinks) == (
        20, 0, [grid.TASKS[cell.task]], [cell.length], 8)
    assert os.path.normpath(os.path.join(ROOT, args.out)) == cell.path
    expected = cell.expected_settings()
    assert expected["retain"] == retain and expected["budgets"] == budget


def test_run_skips_written_cells_and_filters_by_pattern(grid, capsys, monkeypatch):
    monkeypatch.setattr(grid, "model_ready", lambda model: model != grid.RETAIN_TRAINED_RUN)  # as before it trains
    write_cell(grid, "final-recall-128-niah1-2048", 17)
    todo = grid.run(only="*-128-niah1-2048", dry_run=True)
    assert [c.name for c in todo] == ["window-only-128-niah1-2048", "final-keynorm-128-niah1-2048",
                                      "final-recall-block8-128-niah1-2048", "final-128-niah1-2048"]
    out = capsys.readouterr().out
    assert "--window-only" in out and "--retain-block 8" in out
    assert "skipping 1 cells whose run is not trained yet" in out  # the trained-with-retention run's cells wait
    assert len(grid.run(dry_run=True)) == 116 - 18
    with pytest.raises(SystemExit, match="matches no cell"):
        grid.run(only="final-recall-512-*", dry_run=True)


def test_the_claim_holds_with_retention_at_0_85_and_window_only_at_0(grid):
    write_cell(grid, "final-recall-128-niah1-2048", 17)
    write_cell(grid, "window-only-128-niah1-2048", 0)
    text = grid.report_text()
    assert "- training-free: **holds**" in text
    assert "- trained with retention: **undecided (not run)**: retention cell not run" in text
    assert "0.85 (17/20) [0.64, 0.95]" in text and "0.00 (0/20) [0.00, 0.16]" in text
    assert "non-overlapping 95% intervals: **holds**" in text
    measured = grid.Measured
    assert grid.claim_verdict(measured(16 / 20, 20), measured(0.0, 20)) == ("holds", [])  # 0.8 is enough
    assert grid.claim_verdict(measured(15 / 20, 20), measured(0.0, 20))[0] == "does not hold"


def test_the_claim_does_not_hold_below_0_8_or_with_window_only_above_0(grid):
    write_cell(grid, "final-recall-128-niah1-2048", 14)
    write_cell(grid, "window-only-128-niah1-2048", 1, depths=[1.0] + [0.0] * 19)
    text = grid.report_text()
    assert "- training-free: **does not hold**: retention scores 0.70 < 0.8; window-only scores 0.05 > 0" in text
    assert "needle at depth 1.00 (depth 1.00: the end of the haystack" in text
    assert "| 128 | niah_single_1 |" not in text and "no cell ran with both scores yet" in text


def test_the_claim_is_judged_for_the_run_trained_with_retention_too(grid):
    write_cell(grid, "final-recall-128-niah1-2048", 14)
    write_cell(grid, "trained-recall-block8-128-niah1-2048", 17)
    write_cell(grid, "window-only-128-niah1-2048", 0)
    text = grid.report_text()
    assert "read as trained: 0.85 (17/20) [0.64, 0.95]" in text
    assert "- training-free: **does not hold**: retention scores 0.70 < 0.8" in text
    assert "- trained with retention: **holds**" in text
    assert "training-free 0.70, not reached; trained 0.85, reached" in text


def test_trained_and_training_free_are_compared_prompt_by_prompt(grid):
    """The claim's cell read trained and training-free on the same prompts: McNemar's exact test on the
    prompts one answers and the other misses (17 against 13 of 20, 5 and 1 discordant: p = 0.22)."""
    trained = f"trained-recall-block8-{grid.CLAIM_BUDGET}-niah1-{grid.CLAIM_LENGTH}"
    free = f"final-recall-block8-{grid.CLAIM_BUDGET}-niah1-{grid.CLAIM_LENGTH}"
    write_cell(grid, trained, 17)  # samples 0-16 answered
    path = next(c for c in grid.grid() if c.name == free).path
    write_cell(grid, free, 13)
    with open(path) as f:  # answered: 0-11 and 19; so 12-16 by the trained only, 19 by the untrained only
        cell = json.load(f)
    cell["samples"][12]["score"], cell["samples"][19]["score"] = 0.0, 1.0
    with open(path, "w") as f:
        json.dump(cell, f)
    cells = grid.claim_cells()
    text = grid.paired_samples_text("trained", cells["trained"], "untrained", cells["blocks"])
    assert text.endswith("5 answered by the first only, 1 by the second only; McNemar's exact p = 0.22 "
                         "(not shown to differ)")
    assert grid.paired_samples_text("trained", cells["trained"], "untrained", cells["retention"]) is None  # not run
    assert "McNemar's exact p = 0.22" in grid.report_text()


def test_missing_or_mismatched_cells_are_not_run_and_leave_the_claim_undecided(grid):
    text = grid.report_text()
    assert "- training-free: **undecided (not run)**" in text and "0 of 117 cells written" in text
    assert "| niah_single_1 | 2,048 | not run | not run | not run | not run | not run |" in text

    write_cell(grid, "final-recall-128-niah1-2048", 10, count=10, samples=10)  # another run's settings
    write_cell(grid, "window-only-128-niah1-2048", 0)
    text = grid.report_text()
    assert "not the grid's settings: samples 10 (the grid: 20); 10 samples scored (the grid: 20)" in text
    assert "- training-free: **undecided (not run)**: retention cell not run" in text
    assert "1 of 117 cells written" in text


def test_which_score_is_better_needs_non_overlapping_intervals(grid):
    write_cell(grid, "final-recall-128-niah1-2048", 18)
    write_cell(grid, "final-keynorm-128-niah1-2048", 2, retain_score="key_norm")
    write_cell(grid, "final-recall-256-niah2-1024", 12, retain_score="recall")
    write_cell(grid, "final-keynorm-256-niah2-1024", 9, retain_score="key_norm")
    text = grid.report_text()
    assert "| 128 | niah_single_1 | 2,048 | 0.90 (18/20) [0.70, 0.97] | 0.10 (2/20) [0.03, 0.30] | recall |" in text
    assert "| 256 | niah_single_2 | 1,024 | 0.60 (12/20)" in text and "| undecided (intervals overlap) |" in text
    measured = grid.Measured
    assert grid.better_score(measured(0.0, 20), measured(0.9, 20)) == "key_norm"
    assert grid.better_score(measured(0.5, 20), None) == "not both run"


def test_report_writes_the_markdown_file(grid):
    write_cell(grid, "original-full-niah1-1024", 20)
    path = grid.report()
    with open(path) as f:
        text = f.read()
    assert text.startswith("# Retained tokens on S-NIAH") and "1.00 (20/20) [0.84, 1.00]" in text


def test_run_calls_linjax_eval_ruler_once_per_missing_cell(grid, monkeypatch):
    calls = []
    monkeypatch.setattr(grid.subprocess, "run", lambda command, **kwargs: calls.append((command, kwargs)))
    monkeypatch.setattr(grid, "model_ready", lambda model: model != grid.RETAIN_TRAINED_RUN)
    write_cell(grid, "final-recall-128-niah1-2048", 14)
    grid.run(only="*-128-niah1-2048")
    assert [command[command.index("--out") + 1].rsplit("/", 1)[-1] for command, _ in calls] == [
        "window-only-128-niah1-2048.json", "final-keynorm-128-niah1-2048.json",
        "final-recall-block8-128-niah1-2048.json", "final-128-niah1-2048.json"]
    command, kwargs = calls[0]
    assert os.path.basename(command[0]) == "linjax" and command[1:3] == ["eval", "ruler"]
    assert kwargs == {"cwd": grid.ROOT, "check": True}  # a failed cell stops the run


def test_a_partial_cell_is_run_again_with_resume_and_not_reported(grid, monkeypatch):
    calls = []
    monkeypatch.setattr(grid.subprocess, "run", lambda command, **kwargs: calls.append(command))
    write_cell(grid, "original-full-niah1-1024", 20)
    partial = next(c for c in grid.grid() if c.name == "original-full-niah2-1024")
    write_cell(grid, partial.name, 3, count=5)
    with open(partial.path) as f:
        data = json.load(f)
    with open(partial.path, "w") as f:  # as `linjax eval ruler` leaves it when stopped: samples, no finished cell
        json.dump({**data, "complete": False, "results": []}, f)
    assert grid.read_cell(partial) is None
    assert isinstance(grid.read_cell(next(c for c in grid.grid() if c.name == "original-full-niah1-1024")),
                      grid.Measured)
    grid.run(only="original-full-niah*-1024")
    assert [command[command.index("--out") + 1].rsplit("/", 1)[-1] for command in calls] == [
        "original-full-niah2-1024.json", "original-full-niah3-1024.json"]
    assert all(command[-1] == "--resume" for command in calls)


def write_readings(grid, per_token):
    """Per-window WikiText-2 files for each reading: 8 windows in 4 articles, NLL `per_token[reading]`
    per token (plus a small per-window wobble, the same for every reading)."""
    os.makedirs(grid.CELLS, exist_ok=True)
    for reading, nll in per_token.items():
        with open(grid.ppl_path(reading), "w") as f:
            json.dump({"article": [0, 0, 1, 1, 2, 2, 3, 3], "tokens": [1023] * 8,
                       "nll": [1023 * (nll + 0.01 * (i % 3)) for i in range(8)]}, f)


def test_wikitext_section_judges_retention_by_paired_intervals_and_the_seed_spread(grid, monkeypatch):
    claims = grid.claims_module()
    seeds = {row: {"article": [0, 0, 1, 1, 2, 2, 3, 3, 4], "tokens": [1023] * 9, "nll": [1023 * nll] * 9}
             for row, nll in zip(grid.SEED_ROWS, (3.50, 3.52))}  # seed spread 0.02; a 9th window is cut away
    monkeypatch.setattr(claims, "per_window", seeds.get)
    monkeypatch.setattr(grid, "claims_module", lambda: claims)
    assert "Not run yet" in "\n".join(grid.perplexity_lines())
    write_readings(grid, {"retained": 3.51, "window-120": 3.50, "as-trained": 3.52})
    text = "\n".join(grid.perplexity_lines())
    assert "The first 8 of" in text and "(4 articles)" in text
    assert "+0.0100 [+0.0100, +0.0100]" in text  # retained minus window-120, the same on every article
    assert "|seed 1 − seed 2| = 0.0200" in text and "**within the seed spread**" in text
    write_readings(grid, {"retained": 3.60, "window-120": 3.50, "as-trained": 3.52})
    assert "**beyond the seed spread**" in "\n".join(grid.perplexity_lines())



def write_lambada(grid, correct_by_reading, n=10):
    """Each reading's LAMBADA file with its first `correct` of `n` examples right."""
    os.makedirs(grid.CELLS, exist_ok=True)
    for reading, correct in correct_by_reading.items():
        examples = [{"loglikelihood": -1.0, "greedy": i < correct, "target_tokens": 1} for i in range(n)]
        with open(grid.lambada_path(reading), "w") as f:
            json.dump({"limit": n, "examples": examples}, f)


def test_lambada_section_judges_retention_example_by_example_against_the_seed_spread(grid, monkeypatch, tmp_path):
    claims = grid.claims_module()
    monkeypatch.setattr(claims, "eval_dir", lambda row: str(tmp_path / row))
    monkeypatch.setattr(grid, "claims_module", lambda: claims)
    assert "Not run yet" in "\n".join(grid.lambada_lines())
    for row, correct in zip(grid.SEED_ROWS_LAMBADA, (3, 4)):  # seed spread: 10 points on 10 examples
        os.makedirs(tmp_path / row)
        (tmp_path / row / "lambada-full.json").write_text(json.dumps(
            {"examples": [{"greedy": i < correct, "loglikelihood": -1.0} for i in range(12)]}))
    write_lambada(grid, {"retained": 4, "window-120": 5, "as-trained": 3})
    text = "\n".join(grid.lambada_lines())
    assert "the first 10 examples" in text and "| 40.0 | 2.72 |" in text
    assert "+10.0 [+0.0, +30.0]" in text and "-10.0 [-30.0, +0.0]" in text
    assert "|seed 1 − seed 3| = 10.0 points" in text and "**within the seed spread**" in text
    write_lambada(grid, {"retained": 2, "window-120": 5, "as-trained": 3})
    assert "largest loss against the others is 30.0 points: **beyond the seed spread**" in "\n".join(
        grid.lambada_lines())


def test_lambada_scores_each_reading_and_goes_on_where_it_stopped(grid, monkeypatch, tmp_path, tokenizer):
    """`lambada` on a tiny linearized model: every reading's file, their budgets as the three readings', and
    a stopped run finishes the examples it lacks without scoring the others again."""
    from flax import nnx

    import linjax
    from linjax.config import tiny_config
    from linjax.eval import lambada as scorer
    from linjax.eval import models
    from linjax.model import CausalLM

    base = CausalLM(tiny_config("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                max_position_embeddings=512), rngs=nnx.Rngs(0))
    model = linjax.linearize(base, linjax.LinearizeConfig(mechanism="gdn", window=56, sinks=8))
    monkeypatch.setattr(models, "load_model", lambda spec: (model, tokenizer, spec))
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "looked", "at", "the", "dog"]
    texts = [" ".join(words[(i + j) % len(words)] for j in range(40 + 10 * i)) for i in range(5)]  # to ~140 tokens
    (tmp_path / "data" / "lambada").mkdir(parents=True)
    (tmp_path / "data" / "lambada" / "lambada_test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                                           for t in texts))
    claims = grid.claims_module()
    monkeypatch.setattr(claims, "DATA", str(tmp_path / "data"))
    monkeypatch.setattr(grid, "claims_module", lambda: claims)
    scored = []
    real_score = scorer.score
    monkeypatch.setattr(scorer, "score", lambda *a, **k: scored.append(k["done"]) or real_score(*a, **k))

    grid.lambada(limit=3)
    first = {r: read(grid.lambada_path(r)) for r in grid.READINGS}
    assert all(f["complete"] and len(f["examples"]) == 3 for f in first.values())
    assert [(f["window"], f["retain"]) for f in first.values()] == [(56, 64), (120, 0), (56, 0)]
    assert [os.path.getmtime(grid.lambada_path(r)) for r in ("window-120", "as-trained", "retained")] == sorted(
        os.path.getmtime(grid.lambada_path(r)) for r in grid.READINGS)  # the slow, retained reading last
    with pytest.raises(SystemExit, match="scored the first 3 examples"):
        grid.lambada(limit=5)
    for r in grid.READINGS:  # as if stopped after 3 of 5
        data = read(grid.lambada_path(r))
        with open(grid.lambada_path(r), "w") as f:
            json.dump({**data, "limit": 5, "complete": False}, f)
    scored.clear()
    grid.lambada(limit=5)
    assert scored == [3, 3, 3]
    for r in grid.READINGS:
        data = read(grid.lambada_path(r))
        assert data["complete"] and data["examples"][:3] == first[r]["examples"] and len(data["examples"]) == 5


def test_the_fresh_cells_are_the_headline_cells_on_another_seed_with_more_prompts(grid):
    cells = grid.fresh_grid()
    assert len(cells) == 12 and {c.seed for c in cells} == {grid.FRESH_SEED} != {grid.SEED}
    assert {c.name for c in cells}.isdisjoint(c.name for c in grid.grid())  # their own files
    cell = cells[1]
    assert cell.name == "trained-recall-block8-128-niah1-2048-seed1"
    args = build_parser().parse_args(["eval", *cell.arguments()])
    assert (args.samples, args.seed) == (grid.FRESH_SAMPLES, grid.FRESH_SEED)
    assert cell.expected_settings()["samples"] == grid.FRESH_SAMPLES
    assert "Not run yet: `python experiments/retention.py run --fresh`." in grid.report_text()


def test_the_fresh_report_pairs_each_reading_with_window_only(grid):
    cells = {(c.variant, c.budget, c.length): c for c in grid.fresh_grid()}
    window = [i < 5 for i in range(100)]
    free = [i < 3 or 10 <= i < 80 for i in range(100)]  # 3 of window-only's 5, and 70 it misses
    trained = [i < 85 for i in range(100)]
    write_scored_cell(grid, cells["window-only", 128, 2048], window)
    write_scored_cell(grid, cells["final-recall-block8", 128, 2048], free)
    write_scored_cell(grid, cells["trained-recall-block8", 128, 2048], trained)
    text = grid.report_text().split("## The headline cells on fresh prompts")[1].split("\n## ")[0]
    assert "Not run yet" not in text
    row = next(line for line in text.splitlines() if line.startswith("| 128 | 2,048 |"))
    assert "5/100" in row and "73/100" in row and "85/100" in row
    lines = [line for line in text.splitlines() if line.startswith("- 128 tokens, 2,048:")]
    assert len(lines) == 2 and all("against window-only on the same 100 prompts" in line for line in lines)
    assert "70 answered by the first only, 2 by the second only" in lines[0]
    assert "80 answered by the first only, 0 by the second only; McNemar's exact p < 0.001" in lines[1]
    assert not any(line.startswith("- 256 tokens") for line in text.splitlines())  # those cells did not run


def write_scored_cell(grid, cell, scores, haystack=None):
    """A cell's JSON as `linjax eval ruler` writes it (with `--haystack` where given), one score per prompt."""
    os.makedirs(grid.CELLS, exist_ok=True)
    with open(cell.path, "w") as f:
        json.dump({"model": grid.VARIANTS[cell.variant][1],
                   "settings": {"retain_score": "recall", **cell.expected_settings(),
                                **({"haystack": haystack} if haystack else {})},
                   "results": [{"task": grid.TASKS[cell.task], "length": cell.length, "variant": "v",
                                "accuracy": sum(scores) / len(scores), "samples": len(scores)}],
                   "samples": [{"depth": i / len(scores), "score": float(s)} for i, s in enumerate(scores)]}, f)


def test_the_prose_cells_put_the_needle_in_wikitext_with_each_score_in_blocks(grid):
    cells = grid.prose_grid()
    assert len(cells) == 2 * len(grid.PROSE_VARIANTS) == 12
    names = {c.name for c in cells}
    assert names.isdisjoint(c.name for c in grid.grid() + grid.fresh_grid())  # their own files
    assert "original-full-niah2-1024-seed1-wikitext" in names
    keynorm = next(c for c in cells if c.name == "final-keynorm-block8-128-niah2-2048-seed1-wikitext")
    args = build_parser().parse_args(["eval", *keynorm.arguments()])
    assert args.haystack.endswith("wikitext-2-raw-v1.test.nonblank.raw")
    assert (args.retain_score, args.retain_block, args.retain) == ("key_norm", 8, 64)
    assert (args.samples, args.seed, args.tasks) == (grid.PROSE_SAMPLES, grid.FRESH_SEED, ["niah_single_2"])
    # the key-norm variant in blocks reads only in these cells, not in the grid's tables
    attention = next(c for c in cells if c.name == "final-attention-block8-128-niah2-1024-seed1-wikitext")
    assert build_parser().parse_args(["eval", *attention.arguments()]).retain_score == "attention"
    for variant in ("final-keynorm-block8", "final-attention-block8"):
        assert variant not in {c.variant for c in grid.grid()}
        assert grid.VARIANTS[variant][0] not in grid.report_text().split("## S-NIAH-2 in a haystack")[0]


def test_a_prose_cell_scored_on_the_essays_is_not_the_grids(grid):
    cell = next(c for c in grid.prose_grid() if c.variant == "window-only" and c.length == 1024)
    write_scored_cell(grid, cell, [True] * 5 + [False] * 45, "/data/ruler/PaulGrahamEssays.json")
    assert "haystack" in grid.read_cell(cell) and "not the grid's settings" in grid.read_cell(cell)
    write_scored_cell(grid, cell, [True] * 5 + [False] * 45, "/x/wikitext/wikitext-2-raw-v1.test.nonblank.raw")
    assert grid.read_cell(cell).accuracy == pytest.approx(0.1)


def test_the_prose_report_pairs_each_score_with_window_only(grid):
    assert "Not run yet: `python experiments/retention.py run --prose`." in grid.report_text()
    wikitext = "/x/wikitext-2-raw-v1.test.nonblank.raw"
    cells = {(c.variant, c.length): c for c in grid.prose_grid()}
    window = [i < 5 for i in range(50)]
    recall = [i < 3 or 10 <= i < 20 for i in range(50)]  # 3 of window-only's 5, and 10 it misses
    write_scored_cell(grid, cells["window-only", 1024], window, wikitext)
    write_scored_cell(grid, cells["final-recall-block8", 1024], recall, wikitext)
    text = grid.report_text().split("## S-NIAH-2 in a haystack")[1].split("\n## ")[0]
    assert "Not run yet" not in text
    row = next(line for line in text.splitlines() if line.startswith("| 1,024 |"))
    assert "5/50" in row and "13/50" in row and row.count("not run") == 4
    paired = next(line for line in text.splitlines() if line.startswith("- 1,024 tokens:") and "recall" in line)
    assert "10 answered by the first only, 2 by the second only" in paired
