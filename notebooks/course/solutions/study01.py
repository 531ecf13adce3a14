"""Study notebook 01 · training with replay: solutions."""

from pathlib import Path

import numpy as np

import run_study


# S01.1: resample the seeds, keeping each seed's pair together: the seed-to-seed variation both arms share (initial
# weights, prompt order) cancels in the difference, which is why a paired interval is much narrower than an unpaired
# one. The interval is the 2.5th and 97.5th percentiles of the resampled mean differences.
def paired_bootstrap(
    arm: np.ndarray, baseline: np.ndarray, n_boot: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    diffs = np.asarray(arm, dtype=float) - np.asarray(baseline, dtype=float)  # (S,)
    rng = np.random.default_rng(seed)
    means = diffs[rng.integers(0, len(diffs), size=(n_boot, len(diffs)))].mean(axis=1)  # (n_boot,)
    return float(diffs.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


# S01.2: the mean replay_abs_log_ratio over steps 101-150, per run, then over the 8 seeds, for (a) SSR fill + decay 2
# at lr 1e-3 and (b) SSR fill at lr 3e-4. (a) replays younger samples (about 1 step old against 3), yet the policy has
# moved further from them: a step at lr 1e-3 moves it further than a step at 3e-4.
def late_log_ratio(runs: list[dict], arm: str, lr: float, first: int = 101, last: int = 150) -> float:
    per_run = []
    for run in (r for r in runs if r["arm"] == arm and r["learning_rate"] == lr):
        steps, values = run_study.series(run["train"], "step"), run_study.series(run["train"], "replay_abs_log_ratio")
        per_run.append(np.nanmean(values[(steps >= first) & (steps <= last)]))
    return float(np.mean(per_run))


RUNS = run_study.load_raw(Path(run_study.__file__).resolve().parent / "results" / "replay_study" / "raw")
staleness_s01_2 = (late_log_ratio(RUNS, "ssr_fill_decay", 1e-3), late_log_ratio(RUNS, "ssr_fill", 3e-4))

ANSWERS = {"S01.1": paired_bootstrap, "S01.2": staleness_s01_2}
