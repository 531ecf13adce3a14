"""The replay studies' statistics (notebooks/study/run_study.py): hand-computed tests, exact tests at small n, and
the first real-model study's audit reproduced from its raw files."""
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "notebooks" / "study"))
import run_study  # noqa: E402


def test_sign_flip_p_is_exact():
    assert run_study.sign_flip_p(np.array([1.0, 1.0, 1.0])) == pytest.approx(2 / 8)  # only all + and all -
    assert run_study.sign_flip_p(np.array([1.0, -1.0])) == 1.0
    d = np.array([0.3, 0.1, -0.05, 0.2])  # |mean| of the 16 sign patterns, counted by hand: 4 reach 0.1375
    assert run_study.sign_flip_p(d) == pytest.approx(4 / 16)


def test_holm_steps_down_and_stays_monotone():
    adjusted = run_study.holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert adjusted == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
    assert run_study.holm({"a": 0.6, "b": 0.7}) == pytest.approx({"a": 1.0, "b": 1.0})


def test_t_interval_by_hand():
    lo, hi = run_study.t_interval(np.array([1.0, 2.0, 3.0]))  # mean 2, sd 1, t(0.975, 2) = 4.303
    assert (lo, hi) == pytest.approx((2 - 4.303 / 3 ** 0.5, 2 + 4.303 / 3 ** 0.5))


def test_spearman_gives_ties_their_average_rank():
    assert list(run_study.average_ranks(np.array([0.0, 0.0, 1.0, 0.5]))) == [0.5, 0.5, 3.0, 2.0]
    x, y = [0.0, 0.0, 1.0, 2.0], [1.0, 2.0, 3.0, 4.0]
    rx, ry = np.array([0.5, 0.5, 2.0, 3.0]), np.array([0.0, 1.0, 2.0, 3.0])
    assert run_study.spearman(x, y) == pytest.approx(np.corrcoef(rx, ry)[0, 1])


def test_the_first_real_model_study_reproduces_its_audit():
    """SSR fill + decay against GRPO, seeds 0-7: exact p 26/256 on greedy AUC, t-interval [-0.011, +0.218], and the
    three GRPO seeds that got stuck (1, 4, 6), from the raw files alone."""
    runs = run_study.load_raw(ROOT / "notebooks" / "study" / "results" / "replay_study_arithmetic" / "raw")
    table = run_study.replication_table(runs, 200, planned=range(8))
    ssr = table["arms"]["ssr_fill_decay"]["vs_grpo"]
    assert ssr["p_signflip"] == pytest.approx(26 / 256, abs=1e-5) and ssr["ahead"] == 6
    assert ssr["t95"] == pytest.approx([-0.011, 0.218], abs=1e-3)
    assert table["arms"]["grpo"]["stuck_seeds"] == [1, 4, 6] and table["arms"]["ssr_fill_decay"]["stuck_seeds"] == []
    incomplete = run_study.replication_table(runs, 200)  # seeds 8-15 planned: none of these is a test
    assert "vs_grpo" not in incomplete["arms"]["ssr_fill_decay"] and incomplete["decision"] == {}


def test_the_budget_table_pairs_its_hypotheses_and_holds_back_incomplete_ones():
    """budget_table on the replication's raw files, with two of its arms standing in for the budget study's: the
    paired differences are the replication's (DAPO +0.106 over GRPO, exact p 8/256), Holm runs over the two
    hypotheses only, and with the budget study's own 16 seeds planned nothing is tested."""
    runs = run_study.load_raw(ROOT / "notebooks" / "study" / "results" / "replication" / "raw")
    for r in runs:
        r["arm"] = {"grpo_skip_empty": "grpo_matched", "ssr_fill_decay": "ssr_fresh"}.get(r["arm"], r["arm"])
    table = run_study.budget_table(runs, 200, planned=range(8, 16))
    dapo = table["secondary"]["dapo_vs_grpo"]
    assert dapo["mean"] == pytest.approx(0.106, abs=1e-3) and dapo["p_signflip"] == pytest.approx(8 / 256)
    assert "p_holm" not in dapo
    h1, h2 = table["hypotheses"]["dapo_vs_grpo_matched"], table["hypotheses"]["ssr_fresh_vs_grpo"]
    assert h2["p_holm"] == pytest.approx(max(h1["p_holm"], h2["p_signflip"]))
    assert h1["p_holm"] == pytest.approx(min(1, 2 * min(h1["p_signflip"], h2["p_signflip"])))
    assert table["arms"]["dapo"]["completions_per_run"] == 926 and table["arms"]["grpo"]["updates_per_run"] == 20
    pending = run_study.budget_table(runs, 200)
    assert not any(h["complete"] for h in pending["hypotheses"].values())
    assert "p_signflip" not in pending["hypotheses"]["dapo_vs_grpo_matched"]
