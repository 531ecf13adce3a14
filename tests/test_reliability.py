"""Bad input is refused up front with one line; checkpoints lose nothing; signals stop cleanly; seeds reproduce."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import grpo_ssr as g
from conftest import ROOT

SMALL = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
         "--max_completion_length", "8"]

# (flags, the option the message must name)
BAD_CONFIGS = [
    (["--max_steps", "0"], "--max_steps"),
    (["--per_device_train_batch_size", "-1"], "--per_device_train_batch_size"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps"),
    (["--num_iterations", "0"], "--num_iterations"),
    (["--max_completion_length", "0"], "--max_completion_length"),
    (["--max_prompt_length", "0"], "--max_prompt_length"),
    (["--logging_steps", "0"], "--logging_steps"),
    (["--save_steps", "-1"], "--save_steps"),
    (["--num_generations", "1"], "--num_generations"),
    (["--num_generations", "3"], "--num_generations"),  # 16 completions are not whole groups of 3
    (["--temperature", "0"], "--temperature"),
    (["--epsilon", "-0.1"], "--epsilon"),
    (["--epsilon_high", "-1"], "--epsilon_high"),
    (["--beta", "-1"], "--beta"),
    (["--learning_rate", "0"], "--learning_rate"),
    (["--max_grad_norm", "0"], "--max_grad_norm"),
    (["--ssr_alpha", "-1"], "--ssr_alpha"),
    (["--ssr_capacity_scalar", "0"], "--ssr_capacity_scalar"),
    (["--ssr_mode", "append"], "--ssr_mode"),
    (["--ssr_max_age", "-1"], "--ssr_max_age"),
    (["--ssr_age_decay", "-2"], "--ssr_age_decay"),
    (["--loss_type", "ppo"], "--loss_type"),
    (["--replay_buffer_class", "PrioritizedBuffer"], "--replay_buffer_class"),
    (["--device", "tpu"], "--device"),
    (["--reward_funcs", "reward_nope"], "--reward_funcs"),
    (["--reward_weights", "1,2"], "--reward_weights"),
    (["--max_steps", "ten"], "--max_steps"),  # a type error from the parser: one line as well
    (["--dataset", "missing.jsonl"], "--dataset"),
    (["--resume_from_checkpoint", "last"], "--resume_from_checkpoint"),
    (["--eval_steps", "-1"], "--eval_steps"),
    (["--eval_num_generations", "0"], "--eval_num_generations"),
    (["--eval_max_prompts", "-5"], "--eval_max_prompts"),
    (["--dataset", "arithmetic:4"], "--dataset"),
    (["--dataset", "arithmetic:one"], "--dataset"),
]
if not torch.cuda.is_available():
    BAD_CONFIGS.append((["--device", "cuda"], "--device"))


def _cli(args, cwd, timeout=180):
    return subprocess.run([sys.executable, str(ROOT / "grpo_ssr.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def bad_config_results(tmp_path_factory):
    """Run every bad configuration through the CLI at once (each is its own process), two at a time."""
    cwd = tmp_path_factory.mktemp("cli")
    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = list(pool.map(lambda case: _cli(case[0] + ["--output_dir", str(cwd / "out")], cwd), BAD_CONFIGS))
    return dict(zip(range(len(BAD_CONFIGS)), runs)), cwd


@pytest.mark.parametrize("i", range(len(BAD_CONFIGS)), ids=[" ".join(c[0]) for c in BAD_CONFIGS])
def test_bad_option_exits_2_with_one_line_naming_it(bad_config_results, i):
    results, cwd = bad_config_results
    proc, (flags, option) = results[i], BAD_CONFIGS[i]
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and option in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (cwd / "out" / "metrics.jsonl").exists()  # refused before any work


def test_data_and_model_problems_name_the_thing_at_fault(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("{not json\n")
    nocol = tmp_path / "nocol.jsonl"
    nocol.write_text(json.dumps({"text": "hi"}) + "\n")
    badmodel = tmp_path / "model"
    badmodel.mkdir()
    (badmodel / "config.json").write_text("{}")
    cases = [
        (["--dataset", str(empty)], str(empty)),
        (["--dataset", str(garbage)], str(garbage)),
        (["--dataset", str(nocol)], "--prompt_column"),
        (["--dataset", str(tmp_path / "nope.csv")], "nope.csv"),
        (["--model", str(badmodel)], str(badmodel)),
        (["--model", "no-such-org/no-such-model"], "no-such-org/no-such-model"),
    ]
    with ThreadPoolExecutor(max_workers=3) as pool:
        procs = list(pool.map(lambda c: _cli(c[0] + SMALL + ["--output_dir", str(tmp_path / "o")], tmp_path),
                              cases))
    for (flags, name), proc in zip(cases, procs):
        lines = [l for l in proc.stderr.splitlines() if l.strip() and not l.startswith("{")]
        assert proc.returncode == 2, (flags, proc.stderr[-1500:])
        assert len(lines) == 1 and name in lines[0] and "Traceback" not in proc.stderr, (flags, proc.stderr[-1500:])


def test_reward_returning_wrong_count_names_the_function(cfg_factory):
    def short_reward(completions, **kw):
        return [0.0] * (len(completions) - 1)

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[short_reward])
    with pytest.raises(ValueError, match="short_reward.*7 values for 8"):
        trainer.train_step()

    def wordy_reward(completions, **kw):
        return ["good"] * len(completions)

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[wordy_reward])
    with pytest.raises(ValueError, match="wordy_reward.*not a number"):
        trainer.train_step()


def test_nan_and_none_rewards_are_no_score(cfg_factory):
    def patchy(completions, **kw):
        return [math.nan if i % 4 == 0 else (None if i % 4 == 1 else 1.0) for i in range(len(completions))]

    def length(completions, **kw):
        return [float(len(c)) for c in completions]

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[patchy, length], reward_weights=[10.0, 1.0])
    samples = trainer.generate_batch()
    lens = torch.tensor([float(len(trainer.tokenizer.decode(s["completion_ids"][s["completion_mask"].bool()],
                                                            skip_special_tokens=True))) for s in samples])
    expected = lens + torch.tensor([0.0 if i % 4 < 2 else 10.0 for i in range(8)])
    assert trainer.last_gen_metrics["reward"] == pytest.approx(expected.mean().item(), rel=1e-5)
    assert trainer.counters["reward_nan"] == 4
    m = trainer.train_step()
    assert math.isfinite(m["loss"]) and m["reward_nan"] == 8


def test_nonfinite_loss_skips_the_step_and_keeps_the_weights(cfg_factory, monkeypatch, capsys):
    trainer = g.GRPOTrainer(cfg_factory())
    real = g.grpo_loss

    def poisoned(*args, **kw):
        loss, stats = real(*args, **kw)
        return loss * float("nan"), stats

    before = [p.detach().clone() for p in trainer.model.parameters()]
    monkeypatch.setattr(g, "grpo_loss", poisoned)
    m = trainer.train_step()
    assert m["nonfinite_steps"] == 1 and m["skipped"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert "non-finite" in capsys.readouterr().err
    monkeypatch.setattr(g, "grpo_loss", real)
    m = trainer.train_step()
    assert m["skipped"] == 0 and all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def _rows(path):
    """The training lines of a run (evaluation lines, which carry eval_reward, are left out)."""
    return [r for r in map(json.loads, open(path / "metrics.jsonl")) if "eval_reward" not in r]


def _same(a, b, keys=("reward", "loss", "buffer_size", "clip_ratio", "completion_length")):
    return all(a[k] == b[k] for k in keys)


@pytest.mark.parametrize("buffer", ["SSRReplayBuffer", "ReplayBuffer", "fill"])
def test_resume_reproduces_the_uninterrupted_run(cfg_factory, buffer):
    n = 3
    # "fill": SSR in fill mode with an age limit; its fresh batch spans the checkpoint (num_iterations 2)
    extra = dict(replay_buffer_class="SSRReplayBuffer", ssr_mode="fill", ssr_max_age=2) if buffer == "fill" \
        else dict(replay_buffer_class=buffer)
    cfg = cfg_factory(**extra, max_steps=2 * n, save_steps=n, num_iterations=2)
    g.run(cfg)
    out = g.Path(cfg.output_dir)
    full = _rows(out)
    ckpt = out / f"checkpoint-{n}"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    own = torch.load(ckpt / "rank-0.pt", weights_only=False)
    assert own["buffer"]["size"] > 0 and state["step"] == n  # the buffer's contents are in the checkpoint
    resumed = g.run(g.dataclasses.replace(cfg, resume_from_checkpoint=str(ckpt)))
    assert [r["step"] for r in resumed] == list(range(n + 1, 2 * n + 1))
    for a, b in zip(full[n:], resumed):
        assert _same(a, b), (a, b)
    assert [r["step"] for r in _rows(out)] == list(range(1, 2 * n + 1))  # no step lost or repeated


def test_same_seed_same_metrics_bit_for_bit(cfg_factory, tmp_path):
    a = g.run(cfg_factory(output_dir=str(tmp_path / "a"), max_steps=3))
    b = g.run(cfg_factory(output_dir=str(tmp_path / "b"), max_steps=3))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "step_time"} for r in rows]
    assert strip(a) == strip(b)
    c = g.run(cfg_factory(output_dir=str(tmp_path / "c"), max_steps=3, seed=1))
    assert strip(a) != strip(c)


def test_checkpoint_is_atomic_and_complete(cfg_factory):
    cfg = cfg_factory(max_steps=2, save_steps=1)
    g.run(cfg)
    out = g.Path(cfg.output_dir)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert not list(out.glob(".tmp-*"))
    files = {p.name for p in (out / "checkpoint-2").iterdir()}
    assert {"trainer_state.pt", "config.json", "model.safetensors", "tokenizer.json", "grpo_config.json"} <= files
    assert {"trainer_state.pt", "rank-0.pt"} <= files
    state = torch.load(out / "checkpoint-2" / "trainer_state.pt", weights_only=False)
    own = torch.load(out / "checkpoint-2" / "rank-0.pt", weights_only=False)
    assert {"optimizer", "scheduler", "step", "world_size"} <= set(state)
    assert {"buffer", "rng", "prompt_sampler"} <= set(own)
    assert {"python", "numpy", "torch", "cuda"} <= set(own["rng"]) and "generator" in own["buffer"]


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_resumes(tmp_path):
    out = tmp_path / "run"
    args = ["--max_steps", "100000", "--per_device_train_batch_size", "8", "--num_generations", "4",
            "--max_completion_length", "8", "--output_dir", str(out)]
    proc = subprocess.Popen([sys.executable, str(ROOT / "grpo_ssr.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.time() + 120
    while time.time() < deadline:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - t0 < 30
    assert proc.returncode == 0, err[-2000:]
    rows = _rows(out)  # every line parses: nothing torn
    last = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(1, last + 1))
    assert (out / f"checkpoint-{last}" / "trainer_state.pt").is_file()
    assert "resume with --resume_from_checkpoint" in err
    resumed = _cli(["--max_steps", str(last + 2), *args[2:], "--resume_from_checkpoint", "last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["step"] for r in _rows(out)] == list(range(1, last + 3))
