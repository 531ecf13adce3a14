"""What SSR costs over plain GRPO, per step, side by side: SSR `fill` (the defaults) against the uniform buffer.

    python tests/benchmarks/bench_ssr_cost.py                      # tiny model and real model, 3 repeats each
    python tests/benchmarks/bench_ssr_cost.py --models tiny --repeats 5 --out /tmp/ssr_cost.json

Same harness and method as bench_vs_trl.py: each run is its own process (one torch thread), the two arms alternate
within each repeat, the steady state is (end of step 3N - end of step N) / 2N, and the load other processes put on
the machine during each run is recorded (`other_load`, in cores). Inputs are identical for both arms: the tiny
model on the built-in prompts with the default `reward_len` (the default run), and SmolLM2-135M-Instruct on the
arithmetic questions with `reward_accuracy`, the CPU recipe's settings in float32. With a sparse reward SSR also
generates again when a step has nothing to train on (GRPO trains such a step with every advantage 0), which is a
difference in what a step does, not an overhead: the replay study counts it in completions. The target: SSR's
median s/step at most 1.03 times GRPO's. Before issue 20, SSR paid for a
separate old-log-prob forward at every generation that plain GRPO skips; in fill mode every fresh sample is trained
in its own step before any update, so the first training forward now gives those log-probs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

ARMS = {"grpo": "ReplayBuffer", "ssr_fill": "SSRReplayBuffer"}
SETTINGS = {  # model -> RunSpec fields
    # The tiny model at a learning rate that barely moves it: both arms then sample from the same policy, so their
    # completions (up to 64 tokens, most of a step's time) are as long, and the difference is what SSR adds per step.
    "tiny": dict(
        learning_rate=1e-7,
        batch_size=16,
        num_generations=8,
        max_completion_length=64,
        temperature=1.0,
        reward="reward_len",
    ),
    "real": dict(
        learning_rate=2e-5,
        batch_size=16,
        num_generations=8,
        max_completion_length=8,
        temperature=0.7,
        reward="reward_accuracy",
    ),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "real"], choices=list(SETTINGS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--n", type=int, default=None, help="N: steady state from step N to step 3N (default 20 for tiny, 3 for real)"
    )
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "ssr_cost.json"))
    args = p.parse_args(argv)
    report = {"date": h.today(), "machine": h.machine(), "versions": h.versions(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            n = args.n or (20 if model == "tiny" else 3)
            (Path(tmp) / model).mkdir()
            model_dir, data_path = (
                h.prepare_inputs(Path(tmp) / model)[:2] if model == "tiny" else h.prepare_real_inputs(Path(tmp) / model)
            )
            runs = {arm: [] for arm in ARMS}
            for r in range(args.repeats):
                for arm, buffer in ARMS.items():
                    spec = h.RunSpec(
                        trainer="ours",
                        model_dir=model_dir,
                        data_path=data_path,
                        seed=r,
                        result_path=str(Path(tmp) / f"{model}-{arm}-{r}.json"),
                        max_steps=3 * n,
                        replay_buffer_class=buffer,
                        **SETTINGS[model],
                    )
                    res = h.launch(spec)
                    res["s_per_step"] = h.steady_seconds_per_step(res["step_ends"], n)
                    runs[arm].append(res)
                    res["tokens"] = sum(e["tokens"] for e in res["rewards"]) / len(res["rewards"])
                    print(
                        f"{model} repeat {r} {arm:8s}: {res['s_per_step']:.4f} s/step, {res['tokens']:.1f} tokens a "
                        f"completion, other processes {res['other_load']:.2f} cores",
                        flush=True,
                    )
            med = {arm: h.median([x["s_per_step"] for x in v]) for arm, v in runs.items()}
            ratio = med["ssr_fill"] / med["grpo"]
            print(
                f"{model}: median s/step GRPO {med['grpo']:.4f}, SSR fill {med['ssr_fill']:.4f}, ratio {ratio:.3f} "
                f"(target <= 1.03)"
            )
            report["models"][model] = {
                "median_s_per_step": med,
                "ratio": round(ratio, 4),
                "n": n,
                "runs": {
                    arm: [{k: x.get(k) for k in ("s_per_step", "tokens", "wall_s", "other_load")} for x in v]
                    for arm, v in runs.items()
                },
            }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
