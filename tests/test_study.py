"""The replay studies (notebooks/study/run_study.py): the script end to end (raw data, summary, --analyse_only), its
statistics (hand-computed tests, exact tests at small n, greedy measures paired by seed), and the first real-model
study's audit reproduced from its raw files."""

import json
import sys

import numpy as np
import pytest

import grpo_ssr
from conftest import ROOT

NOTEBOOK_DIR = ROOT / "notebooks"
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
    assert (lo, hi) == pytest.approx((2 - 4.303 / 3**0.5, 2 + 4.303 / 3**0.5))


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


@pytest.mark.slow
def test_run_study_end_to_end_and_regenerates_from_raw(tmp_path, capsys):
    """The replay study: raw per-seed data for every (arm, learning rate, seed), paired differences to GRPO with
    bootstrap intervals, cost and staleness; --analyse_only rebuilds the same summary from the raw files alone."""
    sys.path.insert(0, str(NOTEBOOK_DIR / "study"))
    import torch

    import run_study

    out = tmp_path / "study"
    args = [
        "--arms",
        "grpo",
        "ssr_fill",
        "--learning_rates",
        "1e-3",
        "--seeds",
        "0",
        "1",
        "--max_steps",
        "4",
        "--points",
        "2",
        "4",
        "--window",
        "2",
        "--bootstrap",
        "200",
        "--jobs",
        "1",
        "--out_dir",
        str(out),
        "--set",
        "max_completion_length=64",
        "ssr_capacity_scalar=2",
    ]
    threads = torch.get_num_threads()
    try:
        assert run_study.main(args) == 0
    finally:
        torch.set_num_threads(threads)  # the script pins one thread; leave the rest of the suite as it was
    raw = sorted(p.name for p in (out / "raw").iterdir())
    assert raw == [f"{a}-lr0.001-seed{s}.json.gz" for a in ("grpo", "ssr_fill") for s in (0, 1)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["config"]["ssr_capacity_scalar"] == 2
    cell = summary["cells"]["0.001"]
    assert cell["ssr_fill"]["vs_grpo_train"]["auc"]["seeds"] == 2
    assert set(cell["ssr_fill"]["vs_grpo_train"]) == {"auc", "step2", "step4"}
    assert cell["grpo"]["staleness"]["frac_zero_adv_trained"] > 0  # GRPO trains zero-advantage samples
    assert cell["ssr_fill"]["staleness"]["frac_zero_adv_trained"] == 0  # SSR does not
    assert cell["grpo"]["cost"]["completions_per_run"] == 4 * 16
    run = run_study.load_raw(out / "raw")[0]
    assert len(run["train"]["step"]) == 4 and "replay_abs_log_ratio" in run_study.STALENESS
    if not run["eval"]:
        assert any("held-out analysis skipped" in n for n in summary["notes"])
    assert run_study.main(args + ["--analyse_only"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again == summary  # every number comes back from the raw data


def test_run_study_greedy_measures_are_paired_by_seed():
    """--task arithmetic also compares greedy held-out accuracy: its AUC difference to GRPO is the mean over seeds of
    the per-seed trapezoid areas, recomputed here by hand from two arms of the committed tiny study."""
    sys.path.insert(0, str(NOTEBOOK_DIR / "study"))
    import numpy as np

    import run_study

    runs = [
        r
        for r in run_study.load_raw(NOTEBOOK_DIR / "study" / "results" / "replay_study" / "raw")
        if r["learning_rate"] == 3e-4 and r["arm"] in ("grpo", "ssr_fill_decay")
    ]
    assert len(runs) == 16
    summary = run_study.analyse(runs, [50], 10, 200, greedy=True)
    cell = summary["cells"]["0.0003"]["ssr_fill_decay"]

    def auc(r):
        steps, values = np.array(r["eval"]["step"], float), np.array(r["eval"]["eval_greedy_reward"], float)
        return sum((values[i] + values[i + 1]) / 2 * (steps[i + 1] - steps[i]) for i in range(len(steps) - 1)) / (
            steps[-1] - steps[0]
        )

    by = {(r["arm"], r["seed"]): auc(r) for r in runs}
    diffs = [by["ssr_fill_decay", s] - by["grpo", s] for s in range(8)]
    assert cell["vs_grpo_eval_greedy"]["auc"]["mean"] == pytest.approx(float(np.mean(diffs)), abs=1e-6)
    assert cell["vs_grpo_eval_greedy"]["auc"]["ahead"] == sum(d > 0 for d in diffs)
    assert "eval_greedy" not in run_study.analyse(runs, [50], 10, 200)["cells"]["0.0003"]["ssr_fill_decay"]
    task = run_study.TASKS["arithmetic"]
    grpo_ssr.GRPOConfig(**task["flags"], **run_study.ARMS["ssr_fill_decay"])  # the real-model task is a valid config
    assert set(task["arms"]) <= set(run_study.ARMS) and task["flags"]["reward_funcs"] == "reward_accuracy"
