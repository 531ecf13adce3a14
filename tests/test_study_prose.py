"""The budget study's prose says what its raw files say (issue 34, item 7): the cost figures in
notebooks/study/README.md, the notebook's closing cell and the main README are recomputed here from
notebooks/study/results/budget/raw/ and must appear there as written; the wording the audit removed (a cheapest arm
that was not, equivalence where no margin was registered, equal update counts that were not) must not come back.
Reads the raw files only: no training."""

import sys

import nbformat
import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "notebooks" / "study"))
import run_study  # noqa: E402

STUDY_README = ROOT / "notebooks" / "study" / "README.md"
MAIN_README = ROOT / "README.md"
NOTEBOOK = ROOT / "notebooks" / "study" / "03_budget_study.ipynb"
XEON_SEEDS = range(18, 32)  # seeds 16 (every arm) and 17 (`grpo`) ran on the AMD EPYC; 18-31 all on the Xeon
AMD_RUNS = {("grpo", 16), ("grpo", 17), ("dapo", 16), ("grpo_matched", 16), ("ssr_fresh", 16)}


def flat(text: str) -> str:
    """The text with every run of whitespace one space, so a figure wrapped across lines still matches."""
    return " ".join(text.split())


def notebook_prose() -> str:
    return flat("\n".join(c.source for c in nbformat.read(NOTEBOOK, 4).cells if c.cell_type == "markdown"))


@pytest.fixture(scope="module")
def facts():
    runs = run_study.load_raw(ROOT / "notebooks" / "study" / "results" / "budget" / "raw")
    by = {(r["arm"], r["seed"]): r for r in runs}
    assert len(by) == 64
    arm_runs = {a: [r for r in runs if r["arm"] == a] for a in ("grpo", "dapo", "grpo_matched", "ssr_fresh")}
    grpo_cpu = [by["grpo", s]["cpu_s"] for s in XEON_SEEDS]
    ssr_cpu = [by["ssr_fresh", s]["cpu_s"] for s in XEON_SEEDS]
    updates = {a: [run_study.updates(r) for r in rs] for a, rs in arm_runs.items()}
    completions = {a: float(np.mean([run_study.cost(r)["completions"] for r in rs])) for a, rs in arm_runs.items()}
    batch = {a: rs[0]["config"]["per_device_train_batch_size"] for a, rs in arm_runs.items()}
    xeon_mean = {
        a: float(np.mean([r["cpu_s"] for r in rs if (a, r["seed"]) not in AMD_RUNS])) for a, rs in arm_runs.items()
    }
    return {
        "grpo_cpu": float(np.mean(grpo_cpu)),
        "ssr_cpu": float(np.mean(ssr_cpu)),
        "ssr_more": sum(s > g for g, s in zip(grpo_cpu, ssr_cpu)),
        "pairs": len(grpo_cpu),
        "dapo_updates": float(np.mean(updates["dapo"])),
        "dapo_min": min(updates["dapo"]),
        "ssr_updates": float(np.mean(updates["ssr_fresh"])),
        "ssr_min": min(updates["ssr_fresh"]),
        "plain_updates": {a: updates[a] for a in ("grpo", "grpo_matched")},
        "ssr_completions": completions["ssr_fresh"],
        "grpo_completions": completions["grpo"],
        "ssr_extra_batches": (completions["ssr_fresh"] - completions["grpo"]) / batch["ssr_fresh"],
        "amd_over_xeon": min(by[k]["cpu_s"] / xeon_mean[k[0]] for k in AMD_RUNS),
        "cpu_16": {a: float(np.mean([r["cpu_s"] for r in rs])) for a, rs in arm_runs.items()},
        "matched_dearer": sum(by["grpo_matched", s]["cpu_s"] > by["dapo", s]["cpu_s"] for s in range(16, 32)),
    }


def percent_more(f) -> float:
    return 100 * (f["ssr_completions"] / f["grpo_completions"] - 1)


def test_study_readme_states_the_recomputed_cost(facts):
    f, text = facts, flat(STUDY_README.read_text())
    expected = [
        # (a) CPU seconds on one machine, and the pairs where SSR cost more
        f"`grpo` averaged {f['grpo_cpu']:.1f} CPU s a run and `ssr_fresh` {f['ssr_cpu']:.1f}",
        f"`ssr_fresh` cost more on {f['ssr_more']} of the {f['pairs']} pairs",
        f"the arm table's {f['cpu_16']['ssr_fresh']:.0f} CPU s against `grpo`'s {f['cpu_16']['grpo']:.0f} "
        "mixes machines",
        "each AMD EPYC run took more than twice its arm's mean on the Xeon",
        f"Matched GRPO took {f['cpu_16']['grpo_matched']:.0f} CPU s a run and DAPO {f['cpu_16']['dapo']:.0f}",
        f"matched GRPO cost more on all {f['matched_dearer']} seeds",
        # (b) optimizer updates
        f"DAPO averaged {f['dapo_updates']:.2f} updates a run ({f['dapo_min']} at the least) against 20 for `grpo` "
        "and `grpo_matched`",
        f"`ssr_fresh` averaged {f['ssr_updates']:.2f} optimizer updates a run ({f['ssr_min']} at the least)",
        # (c) completions
        f"`ssr_fresh` generated {f['ssr_completions']:.0f} completions a run against `grpo`'s "
        f"{f['grpo_completions']:.0f}, {percent_more(f):.0f}% more",
        f"({f['ssr_extra_batches']:.1f} extra generation batches a run)",
    ]
    missing = [e for e in expected if e not in text]
    assert not missing, f"not in {STUDY_README.relative_to(ROOT)} as recomputed: {missing}"
    # the facts the sentences rest on, beyond their formatting
    assert f["ssr_cpu"] > f["grpo_cpu"] and f["cpu_16"]["ssr_fresh"] < f["cpu_16"]["grpo"]  # why the table misleads
    assert f["amd_over_xeon"] > 2 and f["matched_dearer"] == 16
    assert all(u == [20] * 16 for u in f["plain_updates"].values()) and f["dapo_updates"] < f["ssr_updates"] < 20


def test_notebook_and_main_readme_state_the_same_numbers(facts):
    f, prose = facts, notebook_prose()
    for e in (
        f"`grpo` averaged {f['grpo_cpu']:.1f} CPU s a run and `ssr_fresh` {f['ssr_cpu']:.1f}",
        f"`ssr_fresh` cost more on {f['ssr_more']} of the {f['pairs']} pairs",
        f"DAPO averaged {f['dapo_updates']:.2f} optimizer updates a run ({f['dapo_min']} at the least)",
        f"It averaged {f['ssr_updates']:.2f} optimizer updates a run ({f['ssr_min']} at the least)",
        f"It generated {f['ssr_completions']:.0f} completions a run against GRPO's "
        f"{f['grpo_completions']:.0f}, {percent_more(f):.0f}% more",
    ):
        assert e in prose, f"not in the notebook's prose as recomputed: {e}"
    results = flat(MAIN_README.read_text().split("## Results", 1)[1].split("\n## ", 1)[0])
    assert (
        f"at {f['ssr_completions']:.0f} completions a run against {f['grpo_completions']:.0f} "
        f"({percent_more(f):.0f}% more) and more CPU time on {f['ssr_more']} of {f['pairs']} same-machine pairs"
        in results
    )


@pytest.mark.parametrize(
    "phrase",
    [
        "cheapest arm",
        "matched by",
        "end level",
        "gained as much",
        "explains DAPO's lead as well as",
        "every arm makes the same number",
        "did not beat GRPO",
    ],
)
def test_the_audited_wording_does_not_come_back(phrase):
    for name, text in (
        ("notebooks/study/README.md", STUDY_README.read_text()),
        ("README.md", MAIN_README.read_text()),
        ("the notebook's prose", notebook_prose()),
    ):
        assert phrase.lower() not in flat(text).lower(), f"{phrase!r} is back in {name}"
