"""Shared plumbing for the benchmarks: identical inputs for both trainers, one subprocess per run.

Not a benchmark itself (pytest ignores this folder; see conftest.py). `bench_vs_trl.py` and `bench_memory.py` use it:

- `prepare_inputs` builds the tiny model with grpo_ssr's own builders (seeded), saves model and tokenizer with
  `save_pretrained` to a folder, and writes grpo_ssr's built-in prompts to a .jsonl file. Both trainers load these.
- `launch` runs one trainer in a fresh Python process (`python _harness.py --spec JSON`) and collects, besides the
  JSON the worker writes, the process's wall time and peak resident set size from `os.wait4` (the kernel's
  accounting for exactly that child, so nothing else running in the parent is counted).
- The worker (`run_ours` / `run_trl`) timestamps the end of every optimizer step and records, through a wrapper
  around `grpo_ssr.reward_len` given to both trainers, the mean reward and completion length of every generation batch.

The grpo_ssr under test is whatever `import grpo_ssr` finds first: PYTHONPATH (e.g. a patched copy), else the
repository root.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))  # appended, so that PYTHONPATH can point at another grpo_ssr.py


@dataclass
class RunSpec:
    """Everything one worker process needs; identical for both trainers except `trainer`."""

    trainer: str  # "ours" or "trl"
    model_dir: str
    data_path: str
    result_path: str
    max_steps: int = 60  # 0: build the trainer and stop (the memory of a loaded, idle trainer)
    learning_rate: float = 1e-3
    batch_size: int = 16  # completions per step
    num_generations: int = 8
    max_completion_length: int = 64
    temperature: float = 1.0
    epsilon: float = 0.2
    seed: int = 0
    replay_buffer_class: str = "ReplayBuffer"  # ours only: uniform buffer = plain GRPO
    logits_chunk_size: Optional[int] = None  # ours only; None keeps grpo_ssr's default
    reward: str = "reward_len"  # a reward function of grpo_ssr, given to both trainers
    bf16: bool = False  # bf16 autocast on CPU, in both trainers
    trl_overrides: dict = field(default_factory=dict)  # extra GRPOConfig fields for TRL (e.g. its own defaults)


# ----------------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------------


def prepare_inputs(folder: Path, extra_tokens: int = 0, seed: int = 0) -> tuple[str, str, int]:
    """Save the seeded tiny model + tokenizer and the prompts under `folder`. Returns (model_dir, data_path, vocab)."""
    import torch

    import grpo_ssr

    tokenizer = grpo_ssr.build_tiny_tokenizer(extra_tokens=extra_tokens)
    torch.manual_seed(seed)
    model = grpo_ssr.build_tiny_model(len(tokenizer))
    model_dir = folder / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data_path = folder / "prompts.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n" for r in grpo_ssr.builtin_prompts()))
    return str(model_dir), str(data_path), len(tokenizer)


def prepare_real_inputs(
    folder: Path, model: str = "smollm2-135m-instruct", dataset: str = "arithmetic"
) -> tuple[str, str]:
    """The converted folder of a grpo_ssr model preset and a data set's training rows as a .jsonl file (chat prompts
    and the `answer` column). Returns (model_dir, data_path)."""
    import grpo_ssr

    data_path = folder / "prompts.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n" for r in grpo_ssr.load_prompts(dataset)))
    return str(grpo_ssr.preset_folder(model)), str(data_path)


def make_reward_recorder(log: list, max_completion_length: int = 0, name: str = "reward_len"):
    """A grpo_ssr reward function, unchanged, plus a record of each call (one call per generation batch in both
    trainers)."""
    import grpo_ssr

    func = grpo_ssr.REWARD_FUNCS[name]

    def recorded(completions, **kwargs):
        rewards = func(completions, **kwargs)
        entry = {
            "t": time.perf_counter(),
            "reward": sum(rewards) / len(rewards),
            "chars": sum(len(grpo_ssr.completion_text(c)) for c in completions) / len(completions),
        }
        if kwargs.get("completion_ids") is not None:  # TRL passes the token ids; ours logs lengths in its metrics
            lengths = [len(ids) for ids in kwargs["completion_ids"]]
            entry["tokens"] = sum(lengths) / len(lengths)
            entry["frac_max_length"] = sum(n == max_completion_length for n in lengths) / len(lengths)
        log.append(entry)
        return rewards

    recorded.__name__ = name
    return recorded


# ----------------------------------------------------------------------------------------------------------------------
# Workers: each runs in its own process
# ----------------------------------------------------------------------------------------------------------------------


def run_ours(spec: RunSpec) -> dict:
    import grpo_ssr

    rewards: list = []
    step_ends: list = []

    class TimedTrainer(grpo_ssr.GRPOTrainer):
        def train_step(self):
            metrics = super().train_step()
            step_ends.append(time.perf_counter())
            return metrics

    kwargs = {} if spec.logits_chunk_size is None else {"logits_chunk_size": spec.logits_chunk_size}
    with tempfile.TemporaryDirectory() as out:
        cfg = grpo_ssr.GRPOConfig(
            model=spec.model_dir,
            dataset=spec.data_path,
            output_dir=out,
            overwrite_output_dir=True,
            seed=spec.seed,
            device="cpu",
            max_steps=max(1, spec.max_steps),
            learning_rate=spec.learning_rate,
            per_device_train_batch_size=spec.batch_size,
            num_generations=spec.num_generations,
            max_completion_length=spec.max_completion_length,
            temperature=spec.temperature,
            beta=0.0,
            epsilon=spec.epsilon,
            loss_type="bnpo",
            scale_rewards=True,
            replay_buffer_class=spec.replay_buffer_class,
            bf16=spec.bf16,
            eval_steps=0,
            **kwargs,
        )
        t0 = time.perf_counter()
        trainer = TimedTrainer(cfg, reward_funcs=[make_reward_recorder(rewards, name=spec.reward)])
        t_ready = time.perf_counter()
        history = trainer.train() if spec.max_steps > 0 else []
    for entry, m in zip(rewards, [m for m in history if m.get("generated")]):
        entry["tokens"] = m["completion_length"]
        entry["frac_max_length"] = m["frac_truncated"]  # no EOS within max_completion_length tokens
    return {
        "t0": t0,
        "t_ready": t_ready,
        "step_ends": step_ends,
        "rewards": rewards,
        "grpo_ssr_file": grpo_ssr.__file__,
        "logits_chunk_size": cfg.logits_chunk_size,
    }


def run_trl(spec: RunSpec) -> dict:
    import trl
    from datasets import load_dataset
    from transformers import TrainerCallback

    rewards: list = []
    step_ends: list = []

    class StepTimer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        settings = dict(
            output_dir=out,
            max_steps=max(1, spec.max_steps),
            learning_rate=spec.learning_rate,
            per_device_train_batch_size=spec.batch_size,
            num_generations=spec.num_generations,
            max_completion_length=spec.max_completion_length,
            temperature=spec.temperature,
            top_k=0,
            top_p=1.0,
            min_p=None,
            repetition_penalty=1.0,  # plain temperature sampling, like ours
            beta=0.0,
            epsilon=spec.epsilon,
            loss_type="bnpo",
            scale_rewards="group",
            num_iterations=1,
            use_vllm=False,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            seed=spec.seed,
            # TRL's defaults are bf16 autocast and gradient checkpointing; ours runs fp32 with neither on CPU unless
            # asked, so both get spec.bf16 and the same arithmetic is timed. (Checkpointing only slows TRL down.)
            bf16=spec.bf16,
            gradient_checkpointing=False,
            lr_scheduler_type="linear",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            logging_steps=10,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        settings.update(spec.trl_overrides)
        args = trl.GRPOConfig(**settings)
        t0 = time.perf_counter()
        dataset = load_dataset("json", data_files=spec.data_path, split="train")
        recorder = make_reward_recorder(rewards, spec.max_completion_length, spec.reward)
        trainer = trl.GRPOTrainer(
            model=spec.model_dir, reward_funcs=[recorder], args=args, train_dataset=dataset, callbacks=[StepTimer()]
        )
        gen = trainer.generation_config
        sampling = {
            k: getattr(gen, k)
            for k in ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens")
        }
        t_ready = time.perf_counter()
        if spec.max_steps > 0:
            trainer.train()
    return {
        "t0": t0,
        "t_ready": t_ready,
        "step_ends": step_ends,
        "rewards": rewards,
        "trl_sampling": sampling,
        "trl_version": trl.__version__,
        "trl_settings": {k: v for k, v in settings.items() if k != "output_dir"},
    }


def worker_main(spec_json: str) -> None:
    spec = RunSpec(**json.loads(spec_json))
    import torch

    result = run_ours(spec) if spec.trainer == "ours" else run_trl(spec)
    result.update(spec=asdict(spec), torch_threads=torch.get_num_threads())
    Path(spec.result_path).write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------------------------------
# Parent side
# ----------------------------------------------------------------------------------------------------------------------


def launch(spec: RunSpec, env: Optional[dict] = None, quiet: bool = True) -> dict:
    """Run one worker in a fresh interpreter; return its result plus wall time and peak RSS (os.wait4)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--spec", json.dumps(asdict(spec))]
    sink = subprocess.DEVNULL if quiet else None
    busy_before = _system_busy_seconds()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=sink, stderr=subprocess.PIPE)
    try:
        stderr = proc.stderr.read()  # drain, so a chatty child never blocks on a full pipe
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:  # Ctrl-C or a kill of the benchmark: do not leave the worker running
        proc.kill()
        proc.wait()
        raise
    wall = time.perf_counter() - start
    child_cpu = usage.ru_utime + usage.ru_stime
    # CPU time other processes took while this run ran: on 2 cores, anything big here ruins the timing (torch's
    # threads are sized to the cores, so sharing them slows a run down by far more than the share itself).
    other_cpu = max(0.0, _system_busy_seconds() - busy_before - child_cpu)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = stderr.decode(errors="replace")[-4000:]
        raise RuntimeError(f"{spec.trainer} worker failed with status {proc.returncode}:\n{tail}")
    result = json.loads(Path(spec.result_path).read_text())
    # Linux starts a child's ru_maxrss at its parent's resident size (the high-water mark crosses fork and exec), so
    # this parent imports neither torch nor the trainers: it stays far below any worker's peak.
    result.update(
        wall_s=wall,
        peak_rss_mib=usage.ru_maxrss / 1024,  # ru_maxrss is in KiB on Linux
        cpu_s=child_cpu,
        other_cpu_s=other_cpu,
        other_load=other_cpu / wall,
    )
    return result


def wait_for_quiet(threshold: float = 0.2, sample_s: float = 2.0, max_wait_s: float = 900.0) -> float:
    """Wait until other processes use less than `threshold` cores (sampled over `sample_s` seconds), at most
    `max_wait_s`. Returns the load seen last. Call it only while none of our own workers run."""
    waited, load = 0.0, 0.0
    while True:
        before = _system_busy_seconds()
        time.sleep(sample_s)
        load = (_system_busy_seconds() - before) / sample_s
        if load < threshold or waited >= max_wait_s:
            return load
        if waited == 0.0:
            print(f"  (other processes use {load:.1f} cores; waiting for a quiet machine)", flush=True)
        time.sleep(10.0)
        waited += 10.0 + sample_s


def launch_quiet(
    spec: RunSpec, env: Optional[dict] = None, quiet: bool = True, retries: int = 2, busy: float = 0.1
) -> dict:
    """launch() after wait_for_quiet(); rerun (up to `retries` times) a run that other processes disturbed by
    more than `busy` cores on average. The result says how many attempts it took."""
    for attempt in range(retries + 1):
        wait_for_quiet()
        result = launch(spec, env=env, quiet=quiet)
        if result["other_load"] <= busy:
            break
        print(
            f"  ({spec.trainer}: other processes took {result['other_load']:.2f} cores during the run; "
            f"{'rerunning' if attempt < retries else 'keeping it, flagged'})",
            flush=True,
        )
    result["attempts"] = attempt + 1
    return result


def _system_busy_seconds() -> float:
    """Non-idle CPU seconds of the whole machine since boot, from /proc/stat (0.0 where it is unreadable)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal; guest is already in user


def steady_seconds_per_step(step_ends: list[float], n: int) -> float:
    """(time at the end of step 3N - time at the end of step N) / 2N: start-up and warm-up cancel out."""
    if len(step_ends) < 3 * n:
        raise ValueError(f"need {3 * n} steps, got {len(step_ends)}")
    return (step_ends[3 * n - 1] - step_ends[n - 1]) / (2 * n)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20)
    except OSError:
        pass
    return {"nproc": len(os.sched_getaffinity(0)), "cpu": cpu, "mem_gib": mem_gib}


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "trl", "accelerate", "datasets"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def today() -> str:
    return time.strftime("%Y-%m-%d")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--spec":
        worker_main(sys.argv[2])
    else:
        sys.exit("usage: _harness.py --spec JSON  (run by the benchmarks, not by hand)")
