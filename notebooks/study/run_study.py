"""The replay studies (notebooks/study/README.md): when does replay help GRPO where advantages vanish?

Arms (the flags are in ARMS): plain GRPO, the paper's Filter, SSR in the pull request's replace mode, SSR in the
paper's fill mode, fill with a freshness decay, and replace with a large buffer and no age limit (the failure mode).
Every arm trains the tiny model on reward_len_binary (most groups have zero reward spread) at each learning rate, for
each seed. A seed fixes the initial weights and the prompt order, the same in every arm, so arms are compared seed by
seed: the paired difference to GRPO, with a bootstrap 95% interval over seeds, at fixed steps and for the area under
the curve, on the training reward and (when grpo_ssr has `eval_steps`) on the held-out reward. Cost (completions
generated, wall time) and staleness (clip_ratio, sample age, |log ratio| of replayed tokens) are reported per arm, and
whether replay's gain follows its staleness.

`--task arithmetic` runs the same comparison on the real model (SmolLM2-135M-Instruct on sums, the README's CPU
recipe, TASKS has its settings): GRPO against the replay setting we ship, 8 seeds, held-out accuracy greedy and sampled.

    python notebooks/study/run_study.py                             # the full study: about 30 minutes on 2 cores
    python notebooks/study/run_study.py --task arithmetic           # the real model: about 50 minutes on 2 cores
    python notebooks/study/run_study.py --task replication          # the pre-registered replication
    python notebooks/study/run_study.py --task budget               # the second pre-registered study
    python notebooks/study/run_study.py --seeds 0 1 --max_steps 40 --out_dir /tmp/pilot   # a pilot, with an estimate
    python notebooks/study/run_study.py --analyse_only              # rebuild summary.json from the raw data alone

Writes, under --out_dir (notebooks/study/results/ and the task's folder: replay_study, replay_study_arithmetic or
replication, by default):
    raw/<arm>-lr<lr>-seed<seed>.json.gz   every metrics line of the run (columns, 6 significant digits), its config
                                          and wall time: everything the summary is computed from
    summary.json                          the analysis
Runs go in parallel, --jobs processes (2 by default) of one CPU thread each (OMP_NUM_THREADS=1): the tiny model
gains nothing from more, and on a busy 2-core machine two threads per run can make a step ten times slower.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import io
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Optional

os.environ.setdefault("TQDM_DISABLE", "1")  # before transformers imports tqdm
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the worker processes
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import numpy as np  # noqa: E402

import grpo_ssr  # noqa: E402

SSR = "SSRReplayBuffer"
ARMS = {  # name -> GRPOConfig flags; each arm differs from the one it is compared with in as few flags as possible.
    # Every SSR arm sets ssr_age_decay itself: the file's default (2, chosen by this study) must not leak into them.
    "grpo": dict(replay_buffer_class="ReplayBuffer"),
    "filter": dict(replay_buffer_class=SSR, ssr_mode="fill", ssr_max_age=0),
    "ssr_replace": dict(replay_buffer_class=SSR, ssr_mode="replace", ssr_age_decay=0.0),
    "ssr_fill": dict(replay_buffer_class=SSR, ssr_mode="fill", ssr_age_decay=0.0),
    "ssr_fill_decay": dict(replay_buffer_class=SSR, ssr_mode="fill", ssr_age_decay=2.0),
    "ssr_fill_max_age": dict(replay_buffer_class=SSR, ssr_mode="fill", ssr_max_age=2, ssr_age_decay=0.0),
    "ssr_replace_stale": dict(replay_buffer_class=SSR, ssr_mode="replace", ssr_capacity_scalar=16, ssr_age_decay=0.0),
    # The baselines of the replication (README, "The replication"): is replay's gain more than never taking an
    # empty step (grpo_skip_empty), and does it beat generating until the batch has signal (dapo)?
    "grpo_skip_empty": dict(replay_buffer_class="ReplayBuffer", skip_empty_steps=True),
    "dapo": dict(replay_buffer_class="ReplayBuffer", dynamic_sampling=True),
    # The second real-model study (notebooks/study/README.md, "The budget study"): GRPO given DAPO's completions, as
    # 3 micro-batches of 16 a step (6 prompts x 8, 960 completions a run against DAPO's 926 in the replication), and
    # SSR whose replays are at most one step old.
    "grpo_matched": dict(replay_buffer_class="ReplayBuffer", gradient_accumulation_steps=3),
    "ssr_fresh": dict(replay_buffer_class=SSR, ssr_mode="fill", ssr_max_age=1, ssr_age_decay=0.0),
}
DEFAULT_ARMS = ["grpo", "filter", "ssr_replace", "ssr_fill", "ssr_fill_decay", "ssr_replace_stale"]
BASELINE = "grpo"
REWARD = "reward_len_binary"  # the tiny task's reward
TASKS = {  # --task -> the GRPOConfig flags every run of it shares, and the study's defaults for it
    # The tiny model on the binary length reward: most groups have zero spread, and a run takes seconds.
    "tiny": dict(
        flags=dict(reward_funcs=REWARD, eval_num_generations=8),  # 8 samples a held-out prompt
        arms=DEFAULT_ARMS,
        learning_rates=[1e-3, 3e-4],
        max_steps=150,
        eval_steps=25,
        points_every=50,
        greedy=False,
        out_dir="replay_study",
    ),
    # The real model on sums: the README's CPU recipe (tests/benchmarks/recipe_cpu.py) cut to 20 steps, as in notebook
    # 07, with a held-out evaluation every 5 steps, in float32 so that every CPU runs the same arithmetic. About half of
    # its groups have zero spread. A run takes about 6 minutes on one core, so only the baseline and the replay setting
    # we ship are compared, at the recipe's learning rate.
    "arithmetic": dict(
        flags=dict(
            model="smollm2-135m-instruct",
            dataset="arithmetic",
            reward_funcs="reward_accuracy",
            per_device_train_batch_size=16,
            num_generations=8,
            max_completion_length=8,
            temperature=0.7,
            eval_num_generations=2,
            bf16=False,
        ),
        arms=["grpo", "ssr_fill_decay"],
        learning_rates=[2e-5],
        max_steps=20,
        eval_steps=5,
        points_every=10,
        greedy=True,
        out_dir="replay_study_arithmetic",
    ),
    # The pre-registered replication (README, "The replication"): the same setting on fresh seeds 8-15, arms in
    # order of priority, so that a study stopped early still has whole seeds of the first arms.
    "replication": dict(
        flags=dict(
            model="smollm2-135m-instruct",
            dataset="arithmetic",
            reward_funcs="reward_accuracy",
            per_device_train_batch_size=16,
            num_generations=8,
            max_completion_length=8,
            temperature=0.7,
            eval_num_generations=2,
            bf16=False,
        ),
        arms=["grpo", "grpo_skip_empty", "dapo", "ssr_fill_decay", "filter", "ssr_replace", "ssr_fill"],
        learning_rates=[2e-5],
        max_steps=20,
        eval_steps=5,
        points_every=10,
        greedy=True,
        seeds=list(range(8, 16)),
        out_dir="replication",
    ),
    # The second pre-registered study (notebooks/study/README.md, "The budget study"): the replication's setting on
    # fresh seeds 16-31; is DAPO's lead filtering or data, and does a fresh replay help?
    "budget": dict(
        flags=dict(
            model="smollm2-135m-instruct",
            dataset="arithmetic",
            reward_funcs="reward_accuracy",
            per_device_train_batch_size=16,
            num_generations=8,
            max_completion_length=8,
            temperature=0.7,
            eval_num_generations=2,
            bf16=False,
        ),
        arms=["grpo", "dapo", "grpo_matched", "ssr_fresh"],
        learning_rates=[2e-5],
        max_steps=20,
        eval_steps=5,
        points_every=10,
        greedy=True,
        seeds=list(range(16, 32)),
        out_dir="budget",
    ),
}
# The budget study's two pre-registered hypotheses (Holm over both), then its named secondary comparisons (no
# multiplicity control: reported, not tested as a family).
HYPOTHESES = [("dapo", "grpo_matched"), ("ssr_fresh", "grpo")]
SECONDARY = [("dapo", "grpo"), ("grpo_matched", "grpo"), ("ssr_fresh", "dapo")]
PRIMARY = ("eval_greedy", "auc")  # the replication's primary endpoint: greedy held-out accuracy AUC
DECISION = ("ssr_fill_decay", ["grpo_skip_empty", "dapo"])  # the replay we ship against the two baselines
STALENESS = (
    "clip_ratio",
    "sample_age",
    "replay_abs_log_ratio",
    "frac_zero_adv_trained",
    "unique_sample_frac",
    "replay_frac",
    "frac_reward_zero_std",
    "buffer_ess",
)


# ----------------------------------------------------------------------------------------------------------------------
# Running: one process per run, raw data written as it finishes
# ----------------------------------------------------------------------------------------------------------------------


def compact(value):
    """Six significant digits: the raw files stay small, and no figure the analysis quotes needs more."""
    return float(f"{value:.6g}") if isinstance(value, float) else value


def columns(rows: list[dict]) -> dict[str, list]:
    """Metrics lines -> one list per key (None where a line lacks the key, as skipped steps do)."""
    keys = sorted({k for r in rows for k in r})
    return {k: [compact(r.get(k)) for r in rows] for k in keys}


def run_name(arm: str, lr: float, seed: int) -> str:
    return f"{arm}-lr{lr:g}-seed{seed}"


def run_config(arm: str, lr: float, seed: int, base: dict, output_dir: str = "") -> grpo_ssr.GRPOConfig:
    return grpo_ssr.GRPOConfig(
        **{
            **base,
            **ARMS[arm],
            "learning_rate": lr,
            "seed": seed,
            "output_dir": output_dir,
            "overwrite_output_dir": True,
        }
    )


def recorded_config(cfg: grpo_ssr.GRPOConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k != "output_dir"}


def same_settings(stored: dict, planned: dict) -> bool:
    """A raw file belongs to this plan if every setting it recorded is the planned one. A field the file predates
    counts as the same only at its default (a new option, off)."""
    defaults = recorded_config(grpo_ssr.GRPOConfig())
    return all(stored[k] == v if k in stored else v == defaults[k] for k, v in planned.items())


def pending(plan: list[tuple], base: dict, raw_dir: Path) -> list[tuple]:
    """The runs of the plan that have no raw file yet: the study resumes where it stopped. A raw file with other
    settings stops the study rather than mixing them."""
    todo = []
    for arm, lr, seed in plan:
        path = raw_dir / f"{run_name(arm, lr, seed)}.json.gz"
        if not path.is_file():
            todo.append((arm, lr, seed))
            continue
        with gzip.open(path, "rt") as f:
            stored = json.load(f)["config"]
        if not same_settings(stored, recorded_config(run_config(arm, lr, seed, base))):
            raise SystemExit(f"{path} was run with other settings; move it away, or pass --fresh to start over")
    return todo


def run_one(arm: str, lr: float, seed: int, base: dict, raw_dir: str) -> dict:
    """Train one arm at one learning rate and seed; write its raw file; return its name and wall time."""
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="grpo_ssr_study_") as tmp:
        cfg = run_config(arm, lr, seed, base, tmp)
        start, cpu = time.perf_counter(), time.process_time()
        with contextlib.redirect_stdout(io.StringIO()):  # run() prints a summary line
            try:
                grpo_ssr.run(cfg)
            except grpo_ssr.TrainingStopped:  # a signal (the study's process group was killed): end this worker too,
                if multiprocessing.parent_process() is not None:  # or it would take the next run from the queue
                    os._exit(143)
                raise
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    config = recorded_config(cfg)
    record = {
        "arm": arm,
        "learning_rate": lr,
        "seed": seed,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "config": config,
        "train": columns([r for r in rows if "eval_reward" not in r]),  # eval lines: see INTERFACES.md
        "eval": columns([r for r in rows if "eval_reward" in r]),
    }
    path = Path(raw_dir) / f"{run_name(arm, lr, seed)}.json.gz"
    tmp_path = path.with_name(f".{path.name}.tmp")  # a run stopped mid-write leaves no raw file to resume past
    with gzip.open(tmp_path, "wt") as f:
        json.dump(record, f, separators=(",", ":"))
    tmp_path.replace(path)
    return {"name": path.name, "wall_s": record["wall_s"], "cpu_s": record["cpu_s"]}


def run_all(plan: list[tuple], base: dict, raw_dir: Path, jobs: int) -> None:
    """Run every (arm, lr, seed) of the plan, `jobs` at a time, seed by seed and the arms in their order, so that a
    study stopped early holds whole seeds of the first arms."""
    order = sorted(plan, key=lambda p: (p[2], p[1]))  # stable: the arms keep their order within a seed
    done = 0
    if jobs == 1:  # in this process: what the tests use
        for arm, lr, seed in order:
            out = run_one(arm, lr, seed, base, str(raw_dir))
            done += 1
            print(f"[{done}/{len(plan)}] {out['name']} {out['wall_s']:.1f}s ({out['cpu_s']:.1f} CPU s)", flush=True)
        return
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_one, arm, lr, seed, base, str(raw_dir)) for arm, lr, seed in order]
        for future in as_completed(futures):
            out = future.result()
            done += 1
            print(f"[{done}/{len(plan)}] {out['name']} {out['wall_s']:.1f}s ({out['cpu_s']:.1f} CPU s)", flush=True)


# ----------------------------------------------------------------------------------------------------------------------
# Analysis: everything below reads only the raw files
# ----------------------------------------------------------------------------------------------------------------------


def load_raw(raw_dir: Path) -> list[dict]:
    runs = []
    for path in sorted(raw_dir.glob("*.json.gz")):
        with gzip.open(path, "rt") as f:
            runs.append(json.load(f))
    return runs


def series(columns_: dict, key: str) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in columns_.get(key, [])], dtype=float)


def bootstrap_mean_ci(diffs: np.ndarray, n_boot: int = 10_000, seed: int = 0) -> list[float]:
    """Percentile bootstrap 95% interval of the mean of paired differences, resampling seeds with replacement."""
    diffs = diffs[~np.isnan(diffs)]
    if len(diffs) < 2:
        return [float("nan"), float("nan")]
    rng = np.random.default_rng(seed)
    means = diffs[rng.integers(0, len(diffs), size=(n_boot, len(diffs)))].mean(axis=1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


# Student's t quantile t(0.975, df) for df = 1..30: a 95% interval of a mean over a handful of seeds.
T975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


def t_interval(diffs: np.ndarray) -> list[float]:
    """mean +- t(0.975, n - 1) * sd / sqrt(n): the 95% interval of a mean of paired differences at small n (the
    percentile bootstrap is too narrow there)."""
    d = diffs[~np.isnan(diffs)]
    if len(d) < 2:
        return [float("nan"), float("nan")]
    t = T975[len(d) - 2] if len(d) - 1 <= len(T975) else 1.96
    half = t * d.std(ddof=1) / np.sqrt(len(d))
    return [float(d.mean() - half), float(d.mean() + half)]


def sign_flip_p(diffs: np.ndarray) -> float:
    """Exact two-sided paired permutation test: under no effect each seed's difference is as likely to have either
    sign, so the p-value is the share of the 2^n sign patterns whose |mean| is at least the observed one. With 8
    seeds the smallest possible p is 2/256 = 0.0078."""
    d = diffs[~np.isnan(diffs)]
    if len(d) == 0:
        return float("nan")
    signs = 1 - 2 * ((np.arange(2 ** len(d))[:, None] >> np.arange(len(d))) & 1)  # (2^n, n) of +-1
    means = np.abs((signs * d).mean(axis=1))
    return float(np.mean(means >= abs(d.mean()) - 1e-12))


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment of a family of p-values (controls the family-wise error rate)."""
    order = sorted(pvalues, key=pvalues.get)
    out, running = {}, 0.0
    for i, key in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * pvalues[key]))
        out[key] = running
    return out


def paired(values: dict[int, float], baseline: dict[int, float], n_boot: int) -> dict:
    """Arm minus GRPO, seed by seed: mean, t and bootstrap 95% intervals, the exact sign-flip p-value, and on how
    many seeds the arm was ahead."""
    seeds = sorted(set(values) & set(baseline))
    d = np.array([values[s] - baseline[s] for s in seeds], dtype=float)
    ci = bootstrap_mean_ci(d, n_boot)
    return {
        "mean": round(float(np.nanmean(d)), 5) if len(d) else None,
        "ci95": [round(c, 5) for c in ci],
        "t95": [round(c, 5) for c in t_interval(d)],
        "p_signflip": round(sign_flip_p(d), 5),
        "ahead": int((d > 0).sum()),
        "seeds": len(seeds),
    }


def train_measures(run: dict, points: list[int], window: int) -> dict[str, float]:
    """Training reward: the mean over the `window` steps ending at each point, and over all steps (the area under
    the curve divided by its length)."""
    reward, steps = series(run["train"], "reward"), series(run["train"], "step")
    out = {"auc": float(np.nanmean(reward))}
    for p in points:
        sel = (steps > p - window) & (steps <= p)
        out[f"step{p}"] = float(np.nanmean(reward[sel])) if sel.any() else float("nan")
    return out


def eval_measures(run: dict, points: list[int], key: str = "eval_reward") -> dict[str, float]:
    """Held-out reward at each evaluation point, and the area under its curve (trapezoids) divided by its span."""
    steps, values = series(run["eval"], "step"), series(run["eval"], key)
    if len(steps) == 0:
        return {}
    out = {
        "auc": float(np.trapezoid(values, steps) / (steps[-1] - steps[0])) if len(steps) > 1 else float(values[0]),
        "final": float(values[-1]),
    }
    for p in points:
        if p in steps:
            out[f"step{p}"] = float(values[list(steps).index(p)])
    return out


def staleness(run: dict) -> dict[str, float]:
    """Run means of the replay metrics; |log ratio| is exactly 0 for an arm that never trains an older sample."""
    t = run["train"]
    out = {k: float(np.nanmean(series(t, k))) if np.isfinite(series(t, k)).any() else float("nan") for k in STALENESS}
    age_max = series(t, "sample_age_max")
    out["sample_age_max"] = float(np.nanmax(age_max)) if np.isfinite(age_max).any() else float("nan")
    if np.isnan(out["replay_abs_log_ratio"]) and out["sample_age_max"] == 0:
        out["replay_abs_log_ratio"] = 0.0
    return out


def cost(run: dict) -> dict[str, float]:
    t = run["train"]
    batches = np.nansum(series(t, "generated")) + np.nansum(series(t, "generation_retries"))
    size = run["config"]["per_device_train_batch_size"] * run["config"]["gradient_accumulation_steps"]
    return {
        "completions": float(batches * size),
        "wall_s": run["wall_s"],
        "cpu_s": run["cpu_s"],
        "skipped_steps": float(series(t, "skipped_steps")[-1]),
    }


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1, tied values sharing the mean of their ranks (Filter's |log ratio| is 0 by construction)."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    for value in np.unique(x):
        tied = x == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation, with ties given their average rank."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3:
        return float("nan")
    return float(np.corrcoef(average_ranks(x[keep]), average_ranks(y[keep]))[0, 1])


def _rounded(d: dict, digits: int = 5) -> dict:
    return {
        k: (round(v, digits) if isinstance(v, float) and np.isfinite(v) else (None if isinstance(v, float) else v))
        for k, v in d.items()
    }


def analyse(runs: list[dict], points: list[int], window: int, n_boot: int, greedy: bool = False) -> dict:
    """The summary: per learning rate and arm, paired differences to GRPO, cost and staleness. With `greedy`, the
    held-out measures of greedy decoding too (kind "eval_greedy"), beside those of sampling ("eval")."""
    notes = []
    have_eval = any(len(r["eval"].get("step", [])) for r in runs)
    if not have_eval:
        has_flag = "eval_steps" in {f.name for f in dataclasses.fields(grpo_ssr.GRPOConfig)}
        notes.append(
            "no eval lines in the metrics: held-out analysis skipped ("
            + ("--eval_steps was 0" if has_flag else "this grpo_ssr has no eval_steps yet")
            + ")"
        )
    lrs = sorted({r["learning_rate"] for r in runs}, reverse=True)
    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    out = {"points": points, "window": window, "learning_rates": lrs, "arms": arms, "cells": {}, "notes": notes}
    for lr in lrs:
        cell = {}
        measures = {}
        for arm in arms:
            own = {r["seed"]: r for r in runs if r["arm"] == arm and r["learning_rate"] == lr}
            measures[arm] = {
                s: {"train": train_measures(r, points, window), "eval": eval_measures(r, points)}
                for s, r in own.items()
            }
            if greedy and have_eval:
                for s, r in own.items():
                    measures[arm][s]["eval_greedy"] = eval_measures(r, points, "eval_greedy_reward")
            st = [staleness(r) for r in own.values()]
            co = [cost(r) for r in own.values()]
            cell[arm] = {
                "seeds": sorted(own),
                "train": _rounded(
                    {
                        k: float(np.nanmean([m["train"][k] for m in measures[arm].values()]))
                        for k in next(iter(measures[arm].values()))["train"]
                    }
                ),
                "staleness": _rounded({k: float(np.nanmean([s[k] for s in st])) for k in st[0]}),
                "cost": _rounded(
                    {
                        "completions_per_run": float(np.mean([c["completions"] for c in co])),
                        "wall_s_per_run": float(np.mean([c["wall_s"] for c in co])),
                        "wall_s_total": float(np.sum([c["wall_s"] for c in co])),
                        "cpu_s_per_run": float(np.mean([c["cpu_s"] for c in co])),
                        "skipped_steps_per_run": float(np.mean([c["skipped_steps"] for c in co])),
                    }
                ),
            }
            for kind in ("eval", "eval_greedy") if have_eval else ():
                if kind not in next(iter(measures[arm].values())):
                    continue
                keys = next(iter(measures[arm].values()))[kind]
                cell[arm][kind] = _rounded(
                    {k: float(np.nanmean([m[kind].get(k, np.nan) for m in measures[arm].values()])) for k in keys}
                )
        if BASELINE in measures:
            base = measures[BASELINE]
            for arm in arms:
                if arm == BASELINE:
                    continue
                kinds = ("train", "eval", "eval_greedy") if have_eval else ("train",)
                for kind in [k for k in kinds if k in next(iter(base.values()))]:
                    keys = next(iter(base.values()))[kind]
                    cell[arm][f"vs_grpo_{kind}"] = {
                        k: paired(
                            {s: m[kind].get(k, np.nan) for s, m in measures[arm].items()},
                            {s: m[kind].get(k, np.nan) for s, m in base.items()},
                            n_boot,
                        )
                        for k in keys
                    }
        out["cells"][f"{lr:g}"] = cell
    out["gain_follows_staleness"] = gain_vs_staleness(out, have_eval)
    return out


def gain_vs_staleness(summary: dict, have_eval: bool) -> dict:
    """Across (arm, learning rate) cells: does the paired AUC gain fall as replayed tokens' |log ratio| grows?"""
    rows = []
    for lr, cell in summary["cells"].items():
        for arm, c in cell.items():
            if "vs_grpo_train" in c:
                rows.append(
                    {
                        "arm": arm,
                        "learning_rate": float(lr),
                        "replay_abs_log_ratio": c["staleness"]["replay_abs_log_ratio"],
                        "clip_ratio": c["staleness"]["clip_ratio"],
                        "sample_age": c["staleness"]["sample_age"],
                        "gain_train_auc": c["vs_grpo_train"]["auc"]["mean"],
                        "gain_eval_auc": c["vs_grpo_eval"]["auc"]["mean"] if have_eval else None,
                    }
                )
    out = {"cells": rows}
    for gain in ("gain_train_auc", "gain_eval_auc") if have_eval else ("gain_train_auc",):
        for dist in ("replay_abs_log_ratio", "clip_ratio", "sample_age"):
            out[f"spearman_{gain}_vs_{dist}"] = round(spearman([r[dist] for r in rows], [r[gain] for r in rows]), 3)
    return out


def stuck(run: dict) -> bool:
    """The replication's pre-registered definition: a run is stuck when its greedy held-out accuracy at the last
    evaluation is below its greedy accuracy at step 0 (training made the greedy answers worse)."""
    greedy = series(run["eval"], "eval_greedy_reward")
    return bool(greedy[-1] < greedy[0])


def empty_steps(run: dict) -> int:
    """Steps whose trained samples all had advantage 0: no gradient (with beta 0), whether or not AdamW stepped."""
    return int(np.nansum(series(run["train"], "frac_zero_adv_trained") == 1))


def replication_table(runs: list[dict], n_boot: int, planned: Optional[set[int]] = None) -> dict:
    """The table the protocol (README, "The replication") fixes: per arm, the primary endpoint (greedy held-out
    accuracy AUC) paired with GRPO by seed, its exact sign-flip p-value raw and Holm-adjusted across the arms, the
    t-interval, seeds ahead, stuck seeds, and cost; the secondary endpoints; and the decision comparisons of the
    replay we ship against the two baselines, Holm-adjusted between themselves."""
    kind, key = PRIMARY
    by_arm = {a: {r["seed"]: r for r in runs if r["arm"] == a} for a in ARMS if any(r["arm"] == a for r in runs)}

    def measure(run, kind_, key_):
        return eval_measures(run, [], "eval_greedy_reward" if kind_ == "eval_greedy" else "eval_reward")[key_]

    def versus(arm, other, kind_=kind, key_=key):
        return paired(
            {s: measure(r, kind_, key_) for s, r in by_arm[arm].items()},
            {s: measure(r, kind_, key_) for s, r in by_arm[other].items()},
            n_boot,
        )

    planned = set(TASKS["replication"]["seeds"]) if planned is None else set(planned)  # an arm short of them: no test
    arms, table = list(by_arm), {}
    for arm in arms:
        own = by_arm[arm]
        complete = set(own) == planned and set(by_arm.get(BASELINE, {})) == planned
        co = [cost(r) for r in own.values()]
        row = {
            "seeds": sorted(own),
            "primary": float(np.mean([measure(r, kind, key) for r in own.values()])),
            "stuck_seeds": sorted(s for s, r in own.items() if stuck(r)),
            "empty_steps_per_run": float(np.mean([empty_steps(r) for r in own.values()])),
            "completions_per_run": float(np.mean([c["completions"] for c in co])),
            "wall_s_per_run": float(np.mean([c["wall_s"] for c in co])),
            "cpu_s_per_run": float(np.mean([c["cpu_s"] for c in co])),
        }
        row["complete"] = complete
        if arm != BASELINE and BASELINE in by_arm and not complete:  # protocol: reported, without a test
            d = versus(arm, BASELINE)
            row["vs_grpo_incomplete"] = {k: d[k] for k in ("mean", "ahead", "seeds")}
        elif arm != BASELINE and BASELINE in by_arm:
            row["vs_grpo"] = versus(arm, BASELINE)
            row["vs_grpo_secondary"] = {
                "sampled_auc": versus(arm, BASELINE, "eval", "auc"),
                "greedy_final": versus(arm, BASELINE, "eval_greedy", "final"),
                "sampled_final": versus(arm, BASELINE, "eval", "final"),
            }
        table[arm] = _rounded(row) | {k: v for k, v in row.items() if isinstance(v, (dict, list))}
    family = {a: table[a]["vs_grpo"]["p_signflip"] for a in arms if "vs_grpo" in table[a]}
    for arm, adjusted in holm(family).items():
        table[arm]["vs_grpo"]["p_holm"] = round(adjusted, 5)
    decision = {}
    ssr, baselines = DECISION
    if ssr in by_arm and table[ssr]["complete"]:
        decision = {f"{ssr}_vs_{b}": versus(ssr, b) for b in baselines if b in by_arm and table[b]["complete"]}
        for name, adjusted in holm({n: d["p_signflip"] for n, d in decision.items()}).items():
            decision[name]["p_holm"] = round(adjusted, 5)
    return {"endpoint": f"{kind} {key}", "family": sorted(family), "arms": table, "decision": decision}


def print_replication(rep: dict) -> None:
    print(
        f"replication: primary endpoint {rep['endpoint']}, paired with GRPO by seed (exact sign-flip p, Holm "
        f"across {len(rep['family'])} arms)"
    )
    for arm, row in rep["arms"].items():
        v, partial = row.get("vs_grpo"), row.get("vs_grpo_incomplete")
        vs = (
            (
                f"{v['mean']:+.4f} t95 [{v['t95'][0]:+.4f}, {v['t95'][1]:+.4f}] p {v['p_signflip']:.4f} "
                f"holm {v['p_holm']:.4f} ahead {v['ahead']}/{v['seeds']}"
            )
            if v
            else (
                f"{partial['mean']:+.4f} on {partial['seeds']} seed(s): incomplete, no test"
                if partial
                else "(baseline)"
            )
        )
        print(
            f"  {arm:16s} {row['primary']:.4f}  {vs:62s} stuck {len(row['stuck_seeds'])}/{len(row['seeds'])} "
            f"empty {row['empty_steps_per_run']:.1f}  completions {row['completions_per_run']:.0f}  "
            f"wall {row['wall_s_per_run']:.0f}s"
        )
    for name, d in rep["decision"].items():
        print(
            f"  decision {name}: {d['mean']:+.4f} t95 [{d['t95'][0]:+.4f}, {d['t95'][1]:+.4f}] "
            f"p {d['p_signflip']:.4f} holm {d['p_holm']:.4f} ahead {d['ahead']}/{d['seeds']}"
        )


def replication_markdown(rep: dict) -> str:
    """The protocol's table as Markdown, for the README: `run_study.py --task replication --analyse_only --markdown`."""
    head = (
        "| arm | greedy held-out AUC | vs GRPO (t95) | p exact | p Holm | seeds ahead | stuck seeds | steps without "
        "signal | completions | wall s | CPU s |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for arm, row in rep["arms"].items():
        v, partial = row.get("vs_grpo"), row.get("vs_grpo_incomplete")
        if v:
            vs = (
                f"{v['mean']:+.3f} [{v['t95'][0]:+.3f}, {v['t95'][1]:+.3f}] | {v['p_signflip']:.3f} | "
                f"{v['p_holm']:.3f} | {v['ahead']}/{v['seeds']}"
            )
        elif partial:
            vs = f"{partial['mean']:+.3f} ({partial['seeds']} seed(s), incomplete: no test) | - | - | "
            vs += f"{partial['ahead']}/{partial['seeds']}"
        else:
            vs = "(baseline) | | |"
        rows.append(
            f"| `{arm}` | {row['primary']:.3f} | {vs} | {len(row['stuck_seeds'])}/{len(row['seeds'])} | "
            f"{row['empty_steps_per_run']:.1f} | {row['completions_per_run']:.0f} | {row['wall_s_per_run']:.0f} | "
            f"{row['cpu_s_per_run']:.0f} |"
        )
    rows.append("")
    for name, d in rep["decision"].items():
        rows.append(
            f"- `{name.replace('_vs_', '` against `')}`: {d['mean']:+.3f} [{d['t95'][0]:+.3f}, {d['t95'][1]:+.3f}], "
            f"exact p {d['p_signflip']:.3f}, Holm {d['p_holm']:.3f}, ahead on {d['ahead']} of {d['seeds']} seeds"
        )
    return "\n".join(rows)


def updates(run: dict) -> int:
    """Optimizer updates a run made: its steps less those that skipped AdamW (a skipped or non-finite step)."""
    return int(len(run["train"]["step"]) - np.nansum(series(run["train"], "skipped")))


def budget_table(runs: list[dict], n_boot: int, planned: Optional[set[int]] = None) -> dict:
    """The budget study's table (notebooks/study/README.md): per arm, the primary endpoint (greedy held-out accuracy
    AUC), stuck seeds and cost (completions, optimizer updates, CPU seconds); the two hypotheses, each a paired
    difference by seed with its exact sign-flip p, Holm over the two, and the t-interval; the secondary comparisons
    likewise, without Holm. A comparison whose arms lack some planned seed is reported without a test."""
    kind, key = PRIMARY
    planned = set(TASKS["budget"]["seeds"]) if planned is None else set(planned)
    by_arm = {a: {r["seed"]: r for r in runs if r["arm"] == a} for a in ARMS if any(r["arm"] == a for r in runs)}

    def measure(run, kind_=kind, key_=key):
        return eval_measures(run, [], "eval_greedy_reward" if kind_ == "eval_greedy" else "eval_reward")[key_]

    arms = {}
    for arm, own in by_arm.items():
        co = [cost(r) for r in own.values()]
        arms[arm] = _rounded(
            {
                "primary": float(np.mean([measure(r) for r in own.values()])),
                "completions_per_run": float(np.mean([c["completions"] for c in co])),
                "updates_per_run": float(np.mean([updates(r) for r in own.values()])),
                "cpu_s_per_run": float(np.mean([c["cpu_s"] for c in co])),
                "wall_s_per_run": float(np.mean([c["wall_s"] for c in co])),
            }
        )
        arms[arm].update(seeds=sorted(own), stuck_seeds=sorted(s for s, r in own.items() if stuck(r)))

    def compare(arm, other):
        if arm not in by_arm or other not in by_arm:
            return None
        out = paired(
            {s: measure(r) for s, r in by_arm[arm].items()}, {s: measure(r) for s, r in by_arm[other].items()}, n_boot
        )
        out["complete"] = set(by_arm[arm]) >= planned and set(by_arm[other]) >= planned
        if not out["complete"]:  # protocol: reported, without a test
            out = {k: out[k] for k in ("mean", "ahead", "seeds", "complete")}
        else:
            out["sampled_auc"] = paired(
                {s: measure(r, "eval") for s, r in by_arm[arm].items()},
                {s: measure(r, "eval") for s, r in by_arm[other].items()},
                n_boot,
            )
        return out

    hypotheses = {f"{a}_vs_{b}": compare(a, b) for a, b in HYPOTHESES}
    tested = {n: h["p_signflip"] for n, h in hypotheses.items() if h and h["complete"]}
    if len(tested) == len(HYPOTHESES):  # Holm over the whole family only
        for name, adjusted in holm(tested).items():
            hypotheses[name]["p_holm"] = round(adjusted, 5)
    return {
        "endpoint": f"{kind} {key}",
        "planned_seeds": sorted(planned),
        "arms": arms,
        "hypotheses": hypotheses,
        "secondary": {f"{a}_vs_{b}": compare(a, b) for a, b in SECONDARY},
    }


def budget_markdown(rep: dict) -> str:
    """The budget study's table as Markdown: `run_study.py --task budget --analyse_only --markdown`."""
    rows = ["| comparison | mean difference | t95 | exact p | Holm p | seeds ahead |", "|---|---|---|---|---|---|"]
    for group in ("hypotheses", "secondary"):
        for name, d in rep[group].items():
            label = f"`{name.replace('_vs_', '` against `')}`" + (" (H)" if group == "hypotheses" else "")
            if d is None:
                rows.append(f"| {label} | not run | | | | |")
            elif not d["complete"]:
                rows.append(
                    f"| {label} | {d['mean']:+.3f} ({d['seeds']} seeds, incomplete: no test) | | | | "
                    f"{d['ahead']}/{d['seeds']} |"
                )
            else:
                rows.append(
                    f"| {label} | {d['mean']:+.3f} | [{d['t95'][0]:+.3f}, {d['t95'][1]:+.3f}] | "
                    f"{d['p_signflip']:.4f} | {_fmt(d.get('p_holm'), '.4f')} | {d['ahead']}/{d['seeds']} |"
                )
    rows += [
        "",
        "| arm | greedy held-out AUC | seeds | stuck seeds | completions | updates | CPU s |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, a in rep["arms"].items():
        rows.append(
            f"| `{arm}` | {a['primary']:.3f} | {len(a['seeds'])} | {len(a['stuck_seeds'])} | "
            f"{a['completions_per_run']:.0f} | {a['updates_per_run']:.0f} | {a['cpu_s_per_run']:.0f} |"
        )
    return "\n".join(rows)


def estimate(runs: list[dict], arms: list[str], lrs: list[float], seeds: int, steps: int, jobs: int) -> float:
    """Minutes the given plan would take on `jobs` quiet cores. A run is one thread, so on a core of its own its wall
    time is its CPU time: each arm's CPU seconds per step here times `steps`, plus its start-up (CPU time not spent in
    steps, scaled by the CPU share the steps got). Wall time itself counts whatever else the machine was doing."""

    def per_run(r):
        step_wall = float(np.nansum(series(r["train"], "step_time")))
        share = r["cpu_s"] / r["wall_s"]  # the share of a core this run got
        return step_wall * share / max(1, len(r["train"]["step"])), r["cpu_s"] - step_wall * share

    everyone = [per_run(r) for r in runs]
    total = 0.0
    for arm in arms:
        own = [per_run(r) for r in runs if r["arm"] == arm] or everyone
        total += (np.mean([o[0] for o in own]) * steps + np.mean([o[1] for o in own])) * len(lrs) * seeds
    return float(total / jobs / 60)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_summary(summary: dict) -> None:
    for lr, cell in summary["cells"].items():
        print(f"lr {lr}: training reward, paired difference to GRPO (AUC, mean [95% CI], seeds ahead)")
        for arm, c in cell.items():
            d = c.get("vs_grpo_train", {}).get("auc")
            gain = (
                (
                    f"{_fmt(d['mean'], '+.4f')} [{_fmt(d['ci95'][0], '+.4f')}, {_fmt(d['ci95'][1], '+.4f')}] "
                    f"{d['ahead']}/{d['seeds']}"
                )
                if d
                else "(baseline)"
            )
            st, co = c["staleness"], c["cost"]
            print(
                f"  {arm:18s} auc {_fmt(c['train']['auc'], '.4f')}  {gain:38s} "
                f"|logr| {_fmt(st['replay_abs_log_ratio'], '.3f')} clip {_fmt(st['clip_ratio'], '.3f')} "
                f"age {_fmt(st['sample_age'], '.1f')} completions {co['completions_per_run']:.0f} "
                f"wall {co['wall_s_per_run']:.0f}s"
            )
            for kind, label in (("eval", "held-out, sampled"), ("eval_greedy", "held-out, greedy")):
                if f"vs_grpo_{kind}" in c:
                    d = c[f"vs_grpo_{kind}"]["auc"]
                    print(
                        f"  {'':18s} {label}: auc {_fmt(c[kind]['auc'], '.4f')}  {_fmt(d['mean'], '+.4f')} "
                        f"[{_fmt(d['ci95'][0], '+.4f')}, {_fmt(d['ci95'][1], '+.4f')}] {d['ahead']}/{d['seeds']}"
                    )
    for note in summary["notes"]:
        print("note:", note)


# ----------------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------------


def parse_overrides(items: list[str]) -> dict:
    """FIELD=VALUE strings -> typed GRPOConfig keyword arguments (the type is taken from the field's default)."""
    defaults = vars(grpo_ssr.GRPOConfig())
    types = {f.name: f.type for f in dataclasses.fields(grpo_ssr.GRPOConfig)}
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in defaults or key in ("reward_funcs", "learning_rate", "seed", "output_dir", "max_steps"):
            raise SystemExit(f"--set {item!r}: not a GRPOConfig field this script lets you set")
        kind = type(defaults[key])
        if kind is bool:
            out[key] = value.lower() in ("1", "true", "yes")
        elif defaults[key] is None:  # Optional[...] fields: the annotation (a string) names the type
            annotation = str(types[key])
            out[key] = float(value) if "float" in annotation else int(value) if "int" in annotation else value
        else:
            out[key] = kind(value)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--task",
        default="tiny",
        choices=list(TASKS),
        help="tiny: the tiny model on reward_len_binary; "
        "arithmetic: SmolLM2-135M-Instruct on sums (the CPU recipe); replication and budget: the "
        "pre-registered studies on it. Sets the defaults marked (task)",
    )
    p.add_argument("--arms", nargs="+", default=None, choices=list(ARMS), help="(task)")
    p.add_argument("--learning_rates", type=float, nargs="+", default=None, help="(task)")
    p.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="(task) 0-7; 8-15 for replication; 16-31 for budget"
    )
    p.add_argument("--max_steps", type=int, default=None, help="(task)")
    p.add_argument(
        "--eval_steps",
        type=int,
        default=None,
        help="held-out evaluation every N steps (when grpo_ssr has eval_steps); 0 turns it off (task)",
    )
    p.add_argument(
        "--points",
        type=int,
        nargs="*",
        default=None,
        help="steps for the paired differences (default: every 50 steps, or 20 for arithmetic, and the last)",
    )
    p.add_argument("--window", type=int, default=10, help="training-reward steps averaged at each point")
    p.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples")
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE",
        help="override GRPOConfig fields in every run, e.g. max_completion_length=32",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each")
    p.add_argument(
        "--out_dir",
        default=None,
        help="(task) notebooks/study/results/replay_study, replay_study_arithmetic or replication",
    )
    p.add_argument("--analyse_only", action="store_true", help="skip training; rebuild summary.json from raw/")
    p.add_argument(
        "--markdown",
        action="store_true",
        help="with --task replication, also print the protocol's table as Markdown (the README's)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="delete raw/ first; by default the study resumes, running only the runs that have no raw file yet",
    )
    args = p.parse_args(argv)
    task = TASKS[args.task]
    for key in ("arms", "learning_rates", "max_steps", "eval_steps"):
        if getattr(args, key) is None:
            setattr(args, key, task[key])
    args.seeds = args.seeds if args.seeds is not None else task.get("seeds", list(range(8)))
    args.out_dir = args.out_dir or str(HERE / "results" / task["out_dir"])

    out_dir, started = Path(args.out_dir), time.perf_counter()
    raw_dir = out_dir / "raw"
    base = dict(max_steps=args.max_steps, device="cpu", **task["flags"], **parse_overrides(args.set))
    if "eval_steps" in {f.name for f in dataclasses.fields(grpo_ssr.GRPOConfig)}:
        base["eval_steps"] = args.eval_steps
    if not args.analyse_only:
        raw_dir.mkdir(parents=True, exist_ok=True)
        for stale in raw_dir.glob("*.json.gz") if args.fresh else ():
            stale.unlink()
        plan = [(arm, lr, seed) for arm in args.arms for lr in args.learning_rates for seed in args.seeds]
        todo = pending(plan, base, raw_dir)
        if len(todo) < len(plan):
            print(f"resuming: {len(plan) - len(todo)} of {len(plan)} runs are already in {raw_dir}", flush=True)
        run_all(todo, base, raw_dir, args.jobs)
    runs = load_raw(raw_dir)
    if not runs:
        raise SystemExit(f"no raw runs in {raw_dir}")
    steps = max(len(r["train"]["step"]) for r in runs)
    every = task["points_every"]
    points = args.points or sorted({*range(every, steps + 1, every), steps})
    summary = analyse(runs, points, args.window, args.bootstrap, greedy=task["greedy"])
    if args.task == "replication":
        summary["replication"] = replication_table(runs, args.bootstrap)
    if args.task == "budget":
        summary["budget"] = budget_table(runs, args.bootstrap)
    first = runs[0]
    summary["settings"] = {
        "reward": first["config"]["reward_funcs"],
        "arm_flags": {a: ARMS[a] for a in summary["arms"]},
        "seeds": sorted({r["seed"] for r in runs}),
        "max_steps": steps,
        "jobs": args.jobs,
        "config": first["config"],
        "bootstrap": args.bootstrap,
    }
    if args.task != "tiny":  # the tiny study's summary.json stays byte for byte what it was
        summary["settings"]["task"] = args.task
    summary["environment"] = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
    full = dict(
        arms=task["arms"],
        lrs=task["learning_rates"],
        seeds=len(task.get("seeds", range(8))),
        steps=task["max_steps"],
        jobs=p.get_default("jobs"),
    )
    if not args.analyse_only:
        summary["total_wall_s"] = round(time.perf_counter() - started, 1)
        summary["estimate_full_default_min"] = round(estimate(runs, **full), 1)
    elif (out_dir / "summary.json").is_file():  # keep what only the original run measured
        old = json.loads((out_dir / "summary.json").read_text())
        summary.update({k: old[k] for k in ("total_wall_s", "estimate_full_default_min") if k in old})
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print_summary(summary)
    if "replication" in summary:
        print_replication(summary["replication"])
        if args.markdown:
            print(replication_markdown(summary["replication"]))
    if "budget" in summary:
        print(budget_markdown(summary["budget"]))
    if "estimate_full_default_min" in summary:
        print(
            f"took {summary['total_wall_s']:.0f}s; at this pace the full default {args.task} study "
            f"({len(full['arms'])} arms, learning rates {full['lrs']}, {full['seeds']} seeds, {full['steps']} steps, "
            f"{full['jobs']} jobs) would take about {summary['estimate_full_default_min']:.0f} minutes on quiet "
            f"cores (from CPU time)"
        )
    print(f"wrote {out_dir / 'summary.json'} and {len(runs)} raw runs in {raw_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
