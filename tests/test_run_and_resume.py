"""Running it for real (Part II): the config checked up front with one-line errors (types, limits and choices, prompt
and completion within the model's positions), device and seeds (the record says float32 when bf16 fell back), the
Python API, main() end to end (what a run writes and prints: what replay did, the metrics figure), SIGTERM and
Ctrl-C, checkpoints (a half-written one cleaned away), the output folder (a run removes only what a run writes; a
crashed run does not lock it), resume (a checkpoint knows its run), and the CLI (--help, unknown flags)."""

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import grpo_ssr as g
from conftest import ROOT, SMALL, cli, error_line, metrics_rows, training_rows

# --- the config, checked up front: every mistake a one-line error -----------------------------------------------------

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
    (["--save_total_limit", "0"], "--save_total_limit"),
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
    (["--seed", "-1"], "--seed"),  # every number is >= 0 (NumPy's seed must be)
    (["--seed", str(2**32)], "--seed"),  # and NumPy's seed < 2**32
    (["--eval_dataset", "validation"], "splits are train and test"),  # the tasks made in code have those two
]


if not torch.cuda.is_available():
    BAD_CONFIGS.append((["--device", "cuda"], "--device"))


@pytest.mark.parametrize("flags,option", BAD_CONFIGS, ids=[" ".join(c[0]) for c in BAD_CONFIGS])
def test_bad_option_exits_2_with_one_line_naming_it(flags, option, tmp_path, capsys, keep_threads):
    """main() as the command line calls it, in this process to be quick (the next test runs one as a process)."""
    try:
        code = g.main(flags + ["--output_dir", str(tmp_path / "out")])
    except SystemExit as e:  # argparse's own errors (a value of the wrong type) exit from the parser
        code = e.code
    assert code == 2
    assert option in error_line(capsys)  # one line, "error: ...", no traceback
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before any work


def bad_options(folder, env):
    flags = (["--max_steps", "ten"], ["--ssr_mode", "append"])
    return [(f, cli(f + ["--output_dir", str(folder / "out")], folder, env=env)) for f in flags]


@pytest.mark.background(5, bad_options)
def test_bad_options_on_the_command_line_are_one_line_and_exit_2(background):
    for flags, proc in background:
        lines = [l for l in proc.stderr.splitlines() if l.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("error: ") and flags[0] in lines[0], proc.stderr


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("max_steps", 2.5, "--max_steps 2.5 is invalid: must be an integer, not float"),
        ("max_steps", True, "--max_steps True is invalid: must be an integer, not bool"),
        ("learning_rate", "1e-5", "--learning_rate '1e-5' is invalid: must be a number, not str"),
        (
            "per_device_train_batch_size",
            8.0,
            "--per_device_train_batch_size 8.0 is invalid: must be an integer, not float",
        ),
        ("bf16", "yes", "--bf16 'yes' is invalid: must be true or false, not str"),
        ("ssr_max_age", 1.5, "--ssr_max_age 1.5 is invalid: must be an integer, not float"),
        ("reward_weights", [1.0, "a"], "--reward_weights [1.0, 'a'] is invalid: must be a list of numbers, not list"),
        ("max_steps", 0, "--max_steps 0 is invalid: must be > 0"),
        ("learning_rate", 0.0, "--learning_rate 0.0 is invalid: must be > 0"),
        ("seed", -1, "--seed -1 is invalid: must be >= 0"),
        ("temperature", float("nan"), "--temperature nan is invalid: must be > 0"),
        ("loss_type", "ppo", "--loss_type 'ppo' is invalid: choose one of grpo, bnpo, dr_grpo, dapo"),
    ],
)
def test_types_limits_and_choices_are_checked_when_the_config_is_made(field, value, message):
    with pytest.raises(g.ConfigError) as e:
        g.GRPOConfig(**{field: value})
    assert str(e.value) == message


def test_prompt_and_completion_must_fit_the_models_positions(cfg_factory, tmp_path, capsys, keep_threads):
    with pytest.raises(
        g.ConfigError,
        match=r"--max_prompt_length 512 \+ --max_completion_length 100000 = 100512 "
        r"exceeds the model's 1024 positions",
    ):
        g.GRPOTrainer(cfg_factory(max_completion_length=100000))
    assert g.main([*SMALL, "--max_completion_length", "100000", "--output_dir", str(tmp_path / "o")]) == 2
    assert "1024 positions" in error_line(capsys)
    g.GRPOTrainer(cfg_factory(max_prompt_length=960, max_completion_length=64))  # exactly 1024: fits


# --- device and seeds -------------------------------------------------------------------------------------------------


def test_cpu_has_bf16_reads_torchs_own_probes(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert g.cpu_has_bf16() is False
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert g.cpu_has_bf16() is True


def test_bf16_flag_autocasts_on_cpu(cfg_factory, monkeypatch):
    monkeypatch.setattr(g, "cpu_has_bf16", lambda: True)  # the mechanics, on any CPU (emulated bf16 is only slow)
    device, autocast = g.pick_device("cpu", bf16=True)
    with autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    _, plain = g.pick_device("cpu")
    with plain():
        assert not torch.is_autocast_enabled("cpu")
    trainer = g.GRPOTrainer(cfg_factory(bf16=True, max_steps=1))
    m = trainer.train_step()
    assert m["skipped"] == 0 and m["grad_norm"] > 0


def test_bf16_on_a_cpu_without_bf16_instructions_warns_and_stays_float32(monkeypatch):
    monkeypatch.setattr(g, "cpu_has_bf16", lambda: False)
    with pytest.warns(UserWarning, match=r"this CPU has no native bf16 \(emulated, it is slow\): running float32"):
        device, autocast = g.pick_device("cpu", bf16=True)
    with autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert device.type == "cpu"


@pytest.mark.parametrize(
    "native, bf16, autocast, warns",
    [
        (True, None, True, False),  # an A100 or H100: bf16 by default
        (True, False, False, False),  # --bf16 false turns it off
        (False, None, False, True),  # a T4 or V100: bf16 only emulated, so float32, with one line
        (False, True, False, True),
    ],
)
def test_bf16_on_a_gpu_only_where_it_is_native(monkeypatch, recwarn, native, bf16, autocast, warns):
    """torch.cuda.is_bf16_supported() counts emulation unless asked not to: a T4 would run bf16, slowly."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)
    device, context = g.pick_device("cuda", bf16=bf16)  # no CUDA needed: the autocast is only built, not entered
    assert device.type == "cuda" and (context is not contextlib.nullcontext) == autocast
    assert [str(w.message) for w in recwarn] == (
        ["this CUDA has no native bf16 (emulated, it is slow): running float32"] if warns else []
    )


def test_a_launcher_without_local_rank_is_refused_in_one_line(monkeypatch):
    """WORLD_SIZE without LOCAL_RANK would put every rank on cuda:0."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(
        g.ConfigError, match="WORLD_SIZE is set but LOCAL_RANK is not: start the processes with torchrun"
    ):
        g.pick_device("cuda")


def test_a_bare_bf16_flag_means_true_and_bf16_false_turns_it_off():
    assert g.parse_cli(["--bf16"])[0].bf16 is True
    assert g.parse_cli(["--bf16", "--max_steps", "3"])[0].bf16 is True
    assert g.parse_cli(["--bf16", "false"])[0].bf16 is False
    assert g.parse_cli([])[0].bf16 is None  # auto: the device decides


def test_same_seed_same_metrics_bit_for_bit(cfg_factory, tmp_path):
    a = g.run(cfg_factory(output_dir=str(tmp_path / "a"), max_steps=3))
    b = g.run(cfg_factory(output_dir=str(tmp_path / "b"), max_steps=3))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "step_time"} for r in rows]
    assert strip(a) == strip(b)
    c = g.run(cfg_factory(output_dir=str(tmp_path / "c"), max_steps=3, seed=1))
    assert strip(a) != strip(c)


def test_the_record_says_float32_when_bf16_fell_back(cfg_factory, monkeypatch, keep_threads):
    monkeypatch.setattr(g, "cpu_has_bf16", lambda: False)
    with pytest.warns(UserWarning, match="running float32"):
        trainer = g.GRPOTrainer(cfg_factory(bf16=True))
    assert trainer.record_of_run["bf16"] is False and trainer.record_of_run["precision"] == "float32"
    monkeypatch.setattr(g, "cpu_has_bf16", lambda: True)
    trainer = g.GRPOTrainer(cfg_factory(bf16=True))
    assert trainer.record_of_run["bf16"] is True and trainer.record_of_run["precision"] == "bf16 autocast"


def test_rng_states_hold_only_this_devices_cuda_generator(monkeypatch):
    """Saved on an 8-GPU machine by the process on cuda:3, resumed where it is the only one visible (cuda:0)."""
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([torch.device(device).index]))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("saved every visible GPU's state"))
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append((state, device)))
    states = g.rng_states(torch.device("cuda", 3))
    assert states["cuda"].tolist() == [3]  # one state, this process's device's
    g.set_rng_states(states, torch.device("cuda", 0))
    assert restored == [(states["cuda"], torch.device("cuda", 0))]
    assert g.rng_states(torch.device("cpu"))["cuda"] is None  # a CPU run touches no GPU generator


def test_a_checkpoint_resumes_where_fewer_gpus_are_visible_than_saved_it(cfg_factory, monkeypatch, keep_threads):
    """As on a machine whose CUDA_VISIBLE_DEVICES shrank: restoring all 8 saved GPU states raises IndexError."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(1, dtype=torch.uint8)] * 8)

    def set_all(states):
        if len(states) > 1:
            raise IndexError("list index out of range")

    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
    trainer = g.GRPOTrainer(cfg_factory(max_steps=2))
    trainer.train_step()
    path = trainer.save_checkpoint()
    resumed = g.GRPOTrainer(cfg_factory(max_steps=2, resume_from_checkpoint=str(path)))
    resumed.load_checkpoint(path)
    assert resumed.step == 1


def test_a_bf16_model_from_from_pretrained_trains_float32_master_weights(cfg_factory, tmp_path, capsys, keep_threads):
    """transformers 5's from_pretrained keeps a checkpoint's bf16 (dtype="auto"), TRL's usual code. AdamW on bf16
    weights at lr 1e-6 rounds every update away: the run would learn nothing, silently."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model, tok = g.load_model("tiny")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16
    before = [p.detach().float().clone() for p in loaded.parameters() if p.dim() == 2]
    trainer = g.GRPOTrainer(
        model=loaded,
        processing_class=tok,
        reward_funcs=g.reward_len,
        args=cfg_factory(learning_rate=1e-6, max_steps=2, eval_steps=0),
        train_dataset=g.builtin_prompts(),
    )
    trainer.train()
    after = [p.detach().float() for p in trainer.model.parameters() if p.dim() == 2]
    moved = sum(int((a != b).sum()) for a, b in zip(after, before)) / sum(b.numel() for b in before)
    assert moved > 0.9, f"{moved:.1%} of the weights moved"  # in bf16, only those near 0 (about 2% here)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert "note: the model has bfloat16 weights: training float32 master weights" in capsys.readouterr().err


# --- the Python API, as a TRL user calls it ---------------------------------------------------------------------------


@pytest.mark.slow
def test_python_api_as_a_trl_user_calls_it(tmp_path):
    from datasets import Dataset

    data = Dataset.from_list([{"question": f"Summarise post {i}:", "label": float(i)} for i in range(4)])

    def by_label(completions, label, **kw):
        return label

    def length(completions, **kw):
        return [float(len(c)) for c in completions]

    cfg = g.GRPOConfig(
        output_dir=str(tmp_path / "api"),
        prompt_column="question",
        reward_weights=[1.0, 0.5],
        max_steps=1,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
    )
    model, tok = g.load_model("tiny")
    with pytest.raises(g.ConfigError, match="pass processing_class= .its tokenizer. with this model object"):
        g.GRPOTrainer(cfg, model=model, reward_funcs=[by_label, length], train_dataset=data)
    trainer = g.GRPOTrainer(cfg, model=model, processing_class=tok, reward_funcs=[by_label, length], train_dataset=data)
    assert trainer.dataset[0]["prompt"] == "Summarise post 0:"
    trainer.generate_batch()
    m = trainer.generation_metrics
    assert m["reward"] == pytest.approx(m["rewards/by_label"] + 0.5 * m["rewards/length"], rel=1e-5)
    trainer.train()
    saved = json.loads((tmp_path / "api" / "grpo_config.json").read_text())
    assert saved["reward_funcs"] == "passed from Python: by_label,length"
    assert saved["model"] == "passed from Python: Qwen2ForCausalLM"
    assert saved["dataset"] == "passed from Python: 4 rows" and saved["reward_weights"] == [1.0, 0.5]
    with pytest.raises(g.ConfigError, match="row 0 .*the prompt must be a non-empty string"):
        g.GRPOTrainer(
            g.dataclasses.replace(cfg, output_dir=str(tmp_path / "x")),
            train_dataset=[{"question": ""}],
            reward_funcs=[by_label, length],
        )


# --- a run: main() end to end, what it writes and what it prints ------------------------------------------------------


@pytest.mark.pictures
def test_main_trains_and_writes_everything(tmp_path, capsys):
    out = tmp_path / "run"
    torch.manual_seed(0)
    before, _ = g.load_model("tiny")  # main seeds 0 too, so this is the same initial model
    rc = g.main(
        [
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--per_device_train_batch_size",
            "8",
            "--num_generations",
            "4",
            "--max_completion_length",
            "16",
            "--device",
            "cpu",
        ]
    )
    assert rc == 0
    rows = training_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "loss",
        "completion_length",
        "clip_ratio",
        "buffer_size",
        "step_time",
        "replay_frac",
        "sample_age",
        "adv_abs_trained",
        "adv_abs_fresh",
        "zero_adv_rejected",
        "buffer_ess",
        "frac_zero_adv_trained",
        "unique_sample_frac",
        "sample_age_max",
    ):
        assert key in rows[0], key
    assert "kl" not in rows[0]  # beta = 0
    saved = json.loads((out / "grpo_config.json").read_text())
    assert saved["max_steps"] == 3 and saved["replay_buffer_class"] == "ReplayBuffer"  # the default: plain GRPO
    from transformers import AutoModelForCausalLM, AutoTokenizer

    after = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).pad_token == "<|pad|>"
    changed = [not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values())]
    assert all(changed), "every parameter tensor should move after three AdamW steps"
    # completions are off by default, and the end says where things are
    assert not (out / "completions.jsonl").exists()
    printed = capsys.readouterr().out
    assert not any(line.startswith("replay ") for line in printed.splitlines())  # plain GRPO: no replay line
    assert f"model and tokenizer: {out}/" in printed and f"metrics: {out / 'metrics.jsonl'}" in printed
    assert f"picture: {out / 'metrics.png'}" in printed and (out / "metrics.png").is_file()
    (out / "metrics.png").unlink()  # no picture (matplotlib missing): the end does not point at one
    g.print_outputs(out)
    assert "picture" not in capsys.readouterr().out


@pytest.mark.slow
def test_default_run_learns(default_run):
    """`python grpo_ssr.py` with no flags but the output folder: the reward climbs by at least 10."""
    proc, out = default_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    rewards = [r["reward"] for r in training_rows(out)]
    assert len(rewards) == g.GRPOConfig().max_steps
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert last - first >= 10, (first, last)


@pytest.mark.slow
def test_log_completions_writes_the_batch_and_prints_a_few(tmp_path, capsys):
    out = tmp_path / "o"
    assert (
        g.main(
            [
                "--output_dir",
                str(out),
                "--log_completions",
                "--num_completions_to_print",
                "3",
                "--logging_steps",
                "2",
                *SMALL[2:],
                "--max_steps",
                "4",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    logged = [json.loads(line) for line in open(out / "completions.jsonl")]
    metrics = training_rows(out)
    assert [r["step"] for r in logged] == [2] * 8 + [4] * 8  # every logging step, the whole batch
    for step in (2, 4):
        batch = [r for r in logged if r["step"] == step]
        assert all(r["reward"] == g.reward_len([r["completion"]])[0] == r["rewards/reward_len"] for r in batch)
        assert sum(r["reward"] for r in batch) / 8 == pytest.approx(metrics[step - 1]["reward"], rel=1e-6)
        for group in range(2):
            assert sum(r["advantage"] for r in batch[4 * group : 4 * group + 4]) == pytest.approx(0, abs=1e-4)
        assert len(set(r["prompt"] for r in batch[:4])) == 1
    assert len(re.findall(r"^  step \d+  reward", printed, flags=re.M)) == 6
    assert f"metrics: {out / 'metrics.jsonl'}" in printed and f"completions: {out / 'completions.jsonl'}" in printed
    assert f"model and tokenizer: {out}/" in printed


def _refuse(line):
    raise ValueError(f"not strict JSON: {line}")


def test_metrics_are_strict_json(cfg_factory):
    def unscored(completions, **kw):
        return [None] * len(completions)

    cfg = cfg_factory(max_steps=2)
    g.run(cfg, reward_funcs=[unscored, g.reward_len])
    lines = open(g.Path(cfg.output_dir) / "metrics.jsonl").read().splitlines()
    rows = [json.loads(line, parse_constant=_refuse) for line in lines]  # every line, evaluation lines too
    rows = [r for r in rows if "eval_reward" not in r]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["rewards/unscored"] is None


def test_plot_is_skipped_with_a_note_without_matplotlib(cfg_factory, monkeypatch, capsys):
    cfg = cfg_factory(max_steps=1, eval_steps=0)
    for name in [m for m in g.sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(g.sys.modules, name, None)  # importing any of matplotlib now raises ImportError,
        # also when an earlier test had imported it (its submodules would otherwise still be found)
    g.run(cfg)
    assert not (g.Path(cfg.output_dir) / "metrics.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_the_end_of_a_run_prints_its_reward_and_what_replay_did(tmp_path, capsys, keep_threads):
    """The closing lines carry the figures the README quotes, computed from metrics.jsonl."""
    assert g.main(["--output_dir", str(tmp_path / "o"), "--replay_buffer_class", "SSRReplayBuffer", *SMALL]) == 0
    printed = [l for l in capsys.readouterr().out.splitlines() if l.startswith(("replay ", "training reward"))]
    rows = training_rows(tmp_path / "o")
    mean = lambda key: sum(r[key] for r in rows) / len(rows)
    truncated = f"{mean('frac_truncated'):.0%}"
    assert printed == [
        f"training reward, mean of 2 steps: {mean('reward'):.3g} at the start, {mean('reward'):.3g} "
        f"at the end; truncated completions {truncated} -> {truncated} (2 steps)",
        f"replay (SSR, fill): {mean('replay_frac'):.1%} of trained samples replayed "
        f"(replay_frac), {mean('frac_zero_adv_trained'):.1%} trained with advantage 0; "
        f"{mean('frac_reward_zero_std'):.1%} of groups had no reward spread",
    ], printed
    ssr = g.GRPOConfig(replay_buffer_class="SSRReplayBuffer")
    rows = [
        {
            "reward": -30.0 + i,
            "frac_truncated": 0.5 if i < 2 else 0.0,
            "replay_frac": 0.4,
            "frac_zero_adv_trained": 0.0,
            "frac_reward_zero_std": 0.5,
        }
        for i in range(11)
    ]
    rows.append(
        {
            "reward": -10.0,
            "frac_truncated": 0.0,
            "replay_frac": 0.2,
            "frac_zero_adv_trained": 0.6,
            "frac_reward_zero_std": 0.8,
        }
    )
    assert g.summary_lines(rows, ssr) == [  # the first 10 rewards -30..-21; the last -28..-20 and -10, mean -22.6
        "training reward, mean of 10 steps: -25.5 at the start, -22.6 at the end; truncated completions 10% -> 0% "
        "(12 steps)",
        "replay (SSR, fill): 38.3% of trained samples replayed (replay_frac), 5.0% trained with advantage 0; 52.5% "
        "of groups had no reward spread",
    ]  # (11 x 0.4 + 0.2) / 12, 0.6 / 12, (11 x 0.5 + 0.8) / 12
    assert g.summary_lines(rows, g.GRPOConfig(replay_buffer_class="ssr", ssr_mode="replace"))[1].startswith(
        "replay (SSR, replace): "
    )
    assert len(g.summary_lines(rows, g.GRPOConfig())) == 1  # plain GRPO replays nothing: the reward line only
    assert g.summary_lines([], ssr) == []


@pytest.mark.pictures
def test_metrics_figure_has_a_replay_panel_a_title_and_smoothed_lines(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    rows = [
        {
            "step": s,
            "reward": -30 + s + (-1) ** s * 3,
            "replay_frac": 0.5 + (-1) ** s * 0.1,
            "frac_zero_adv_trained": 0.1,
            "frac_reward_zero_std": 0.3,
            "clip_ratio": 0.0,
            "completion_length": 9,
        }
        for s in range(1, 41)
    ]
    rows.insert(0, {"step": 0, "eval_reward": -30.0, "eval_greedy_reward": -31.0})
    (out / "metrics.jsonl").write_text("".join(g.json_line(r) for r in rows))
    (out / "grpo_config.json").write_text(json.dumps({**g.dataclasses.asdict(g.GRPOConfig()), "model": "tiny"}))
    smoothing = "(thin: each step; thick: the mean of the last 2 step(s))"  # 40 steps // 20: stated on the plot
    plain = g.plot_metrics(out)
    assert plain.get_suptitle() == f"model tiny   reward reward_len   buffer ReplayBuffer   {smoothing}"
    assert "share of the trained samples: no replay" in {ax.get_title() for ax in plain.axes}  # why it is empty
    (out / "grpo_config.json").write_text(
        json.dumps({**g.dataclasses.asdict(g.GRPOConfig()), "model": "tiny", "replay_buffer_class": "SSRReplayBuffer"})
    )
    (out / "metrics.png").unlink()
    fig = g.plot_metrics(out)
    assert (out / "metrics.png").stat().st_size > 0
    assert fig.get_suptitle() == f"model tiny   reward reward_len   buffer SSRReplayBuffer (fill)   {smoothing}"
    assert len(fig.axes) == 8  # 2 x 4 panels
    by_title = {ax.get_title(): ax for ax in fig.axes}
    assert {"frac_truncated (no EOS)", "grad_norm (before clipping)"} <= set(by_title)
    replay = by_title["share of the trained samples"]
    labels = [line.get_label() for line in replay.get_lines()]
    assert "replay_frac" in labels and "frac_zero_adv_trained" in labels
    raw, smoothed = [line.get_ydata() for line in by_title["training reward (generation batch)"].get_lines()]
    assert len(raw) == len(smoothed) == 40 and max(abs(a - b) for a, b in zip(raw, smoothed)) > 1
    assert max(smoothed[2:]) - min(smoothed[2:]) < max(raw) - min(raw)  # the zig-zag is averaged out


# --- SIGTERM: the step finishes, a checkpoint is saved, the run resumes -----------------------------------------------


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_resumes(tmp_path):
    out = tmp_path / "run"
    args = [
        "--max_steps",
        "100000",
        "--per_device_train_batch_size",
        "8",
        "--num_generations",
        "4",
        "--max_completion_length",
        "8",
        "--output_dir",
        str(out),
    ]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "grpo_ssr.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - t0 < 30
    assert proc.returncode == 143, err[-2000:]  # 128 + SIGTERM, as a shell reports a stopped process
    rows = training_rows(out)  # every line parses: nothing torn
    last = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(1, last + 1))
    assert (out / f"checkpoint-{last}" / "trainer_state.pt").is_file()
    assert "resume with --resume_from_checkpoint" in err
    resumed = cli(["--max_steps", str(last + 2), *args[2:], "--resume_from_checkpoint", "last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["step"] for r in training_rows(out)] == list(range(1, last + 3))


# --- Ctrl-C from Python and from the CLI: a checkpoint is saved, the resume line printed ------------------------------


def _ctrl_c_on_call(n):
    calls = []

    def interrupting(completions, **kw):
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, delivered to this process's handler
        return g.reward_len(completions)

    return interrupting


def test_ctrl_c_from_python_saves_a_checkpoint_then_raises(cfg_factory, capsys, keep_threads):
    cfg = cfg_factory(max_steps=5, eval_steps=0)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[_ctrl_c_on_call(2)])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    out = g.Path(cfg.output_dir)
    assert trainer.step == 2 and (out / "checkpoint-2" / "trainer_state.pt").is_file()
    assert [r["step"] for r in trainer.state.log_history] == [1, 2]
    assert "resume with --resume_from_checkpoint" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers were given back


@pytest.mark.parametrize("sig, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_from_the_cli_exits_128_plus_its_number_with_the_resume_line(
    sig, status, tmp_path, monkeypatch, capsys, keep_threads
):
    """A stopped run must not look finished to a script or a scheduler: the shell's status, 128 + the signal."""
    (tmp_path / f"stop_{sig}.py").write_text(
        textwrap.dedent(f"""\
        import os, signal
        import grpo_ssr
        calls = []
        def stop(completions, **kw):
            calls.append(1)
            if len(calls) == 1:
                os.kill(os.getpid(), signal.{sig})
            return grpo_ssr.reward_len(completions)
        """)
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "o"
    assert (
        g.main(["--output_dir", str(out), "--eval_steps", "0", "--reward_funcs", f"stop_{sig}.stop", *SMALL]) == status
    )
    assert f"resume with --resume_from_checkpoint {out / 'checkpoint-1'}" in capsys.readouterr().err


# --- checkpoints ------------------------------------------------------------------------------------------------------


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
    assert {"buffer", "rng", "prompts_drawn"} <= set(own)
    assert {"python", "numpy", "torch", "cuda"} <= set(own["rng"])
    assert "generator" not in own["buffer"] and isinstance(own["buffer_generator"], torch.Tensor)  # saved beside it
    assert own["buffer"].keys() == vars(g.make_buffer(cfg)).keys() - {"generator"}  # the buffer's whole state


@pytest.mark.slow
def test_save_total_limit_keeps_the_newest_checkpoints(cfg_factory):
    cfg = cfg_factory(max_steps=4, save_steps=1, save_total_limit=2)
    g.run(cfg)
    out = g.Path(cfg.output_dir)
    assert [p.name for p in g.checkpoints(out)] == ["checkpoint-3", "checkpoint-4"]  # oldest first: [-1] is "last"


@pytest.mark.parametrize("buffer", ["SSRReplayBuffer", "ReplayBuffer"])
def test_checkpoint_loads_with_a_non_cpu_map_location(cfg_factory, monkeypatch, buffer):
    """As on CUDA: every tensor torch.load would place on the trainer's device goes to `meta` instead. The
    generator state and the priorities must still be read onto the CPU, and training must go on."""
    cfg = cfg_factory(replay_buffer_class=buffer, max_steps=2, save_steps=2)
    g.run(cfg)
    ckpt = str(g.Path(cfg.output_dir) / "checkpoint-2")
    trainer = g.GRPOTrainer(g.dataclasses.replace(cfg, max_steps=4, resume_from_checkpoint=ckpt))
    real_load = torch.load

    def load_as_if_on_gpu(f, *a, map_location=None, **kw):
        if map_location != "cpu":  # the trainer's device: pretend it is not the CPU
            map_location = "meta"
        return real_load(f, *a, map_location=map_location, **kw)

    monkeypatch.setattr(torch, "load", load_as_if_on_gpu)
    trainer.load_checkpoint(g.Path(cfg.output_dir) / "checkpoint-2")
    monkeypatch.setattr(torch, "load", real_load)
    assert trainer.buffer.generator.get_state().device.type == "cpu"
    if buffer == "SSRReplayBuffer":
        assert trainer.buffer.priorities.device.type == "cpu"
    assert all(
        v.device.type == "cpu"
        for s in trainer.buffer.slots
        if s is not None
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    m = trainer.train_step()
    assert m["step"] == 3 and math.isfinite(m["loss"])


def test_a_half_written_checkpoint_is_cleaned_away_on_the_next_start(cfg_factory, keep_threads):
    cfg = cfg_factory(max_steps=2, save_steps=2)
    g.run(cfg)
    out = g.Path(cfg.output_dir)
    (out / ".tmp-checkpoint-7").mkdir()  # what a second Ctrl-C during a save leaves (os._exit)
    (out / ".tmp-checkpoint-7" / "model.safetensors").write_text("half")
    g.run(g.dataclasses.replace(cfg, resume_from_checkpoint="last", max_steps=3))
    assert not (out / ".tmp-checkpoint-7").exists()
    assert [r["step"] for r in metrics_rows(out) if "eval_reward" not in r] == [1, 2, 3]


# --- the output folder: a run removes only what a run writes ----------------------------------------------------------


def _files_save_pretrained_writes(tmp_path) -> set:
    model, tok = g.load_model("tiny")
    folder = tmp_path / "plain_save"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return {p.name for p in folder.iterdir()}


@pytest.mark.pictures
@pytest.mark.slow
def test_overwrite_removes_only_what_the_run_wrote(tmp_path, capsys):
    out = tmp_path / "here"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    data = out / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}:"}) + "\n" for i in range(4)))
    args = ["--output_dir", str(out), "--dataset", str(data), *SMALL]
    assert g.main(args + ["--save_steps", "1"]) == 0
    written = _files_save_pretrained_writes(tmp_path)
    assert written <= {p.name for p in out.iterdir()}
    capsys.readouterr()
    assert g.main(args) == 2
    line = error_line(capsys)
    assert "already holds a run" in line and "--output_dir" in line
    assert g.main(args + ["--overwrite_output_dir", "--max_steps", "1"]) == 0
    assert (out / "notes.txt").read_text() == "my notes" and data.is_file()
    assert [r["step"] for r in training_rows(out)] == [1]  # the old run's lines are gone, not appended to
    assert not list(out.glob("checkpoint-*"))  # the old run's checkpoints went with it
    assert {p.name for p in out.iterdir()} == {
        "notes.txt",
        "prompts.jsonl",
        "metrics.jsonl",
        "grpo_config.json",
        "metrics.png",
        *written,
    }


def test_train_twice_in_one_folder_is_refused(cfg_factory):
    cfg = cfg_factory(max_steps=2)
    g.GRPOTrainer(cfg).train()
    with pytest.raises(g.ConfigError, match="already holds a run"):
        g.GRPOTrainer(cfg).train()
    assert [r["step"] for r in training_rows(g.Path(cfg.output_dir))] == [1, 2]


def test_a_run_that_crashed_before_its_first_step_is_started_over(cfg_factory, capsys, keep_threads):
    def broken(completions, **kw):
        raise RuntimeError("my bug")

    cfg = cfg_factory(max_steps=2)
    with pytest.raises(RuntimeError, match="my bug"):  # the user's own traceback
        g.run(cfg, reward_funcs=[broken])
    out = g.Path(cfg.output_dir)
    assert (out / "grpo_config.json").is_file() and (out / "metrics.jsonl").is_file()
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    g.run(cfg)  # the fixed command, in the same folder
    assert [r["step"] for r in metrics_rows(out) if "eval_reward" not in r] == [1, 2]
    assert (out / "notes.txt").read_text() == "mine"
    with pytest.raises(
        g.ConfigError, match="already holds a run; pass --overwrite_output_dir to replace it, or another --output_dir"
    ):  # a real run: kept; no checkpoint to suggest
        g.GRPOTrainer(cfg)


def test_a_reward_with_the_wrong_count_is_one_line_and_the_fixed_command_runs(
    tmp_path, monkeypatch, capsys, keep_threads
):
    (tmp_path / "bad_rewards.py").write_text(
        "def short(completions, **kw):\n    return [0.0] * (len(completions) - 1)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TQDM_DISABLE", "1")  # the progress bar is not what is tested: stderr holds only the error
    args = ["--output_dir", str(tmp_path / "o"), "--eval_steps", "0", *SMALL]
    assert g.main(args + ["--reward_funcs", "bad_rewards.short"]) == 2
    assert error_line(capsys) == (  # the phase it failed in, then what is wrong
        "error: training step 1: reward function 'short' returned [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0] for 8 "
        "completions: return one finite number (or None) per completion"
    )
    assert not (tmp_path / "o").exists()  # refused before its first step: the folder it made is gone
    # the same reward, first met in the held-out pass before any training (12 prompts x (1 greedy + 1 sampled))
    held_out = ["--eval_steps", "2", "--eval_max_prompts", "12", "--eval_num_generations", "1"]
    assert g.main(args + held_out + ["--reward_funcs", "bad_rewards.short"]) == 2
    assert error_line(capsys).startswith("error: the held-out pass at step 0: reward function 'short' returned")
    assert not (tmp_path / "o").exists()
    (tmp_path / "o").mkdir()  # a folder the user made stays, empty as it was
    assert g.main(args + ["--reward_funcs", "bad_rewards.short"]) == 2
    assert list((tmp_path / "o").iterdir()) == []
    assert g.main(args) == 0


# --- resume: a checkpoint knows its run -------------------------------------------------------------------------------


def _same(a, b, keys=("reward", "loss", "buffer_size", "clip_ratio", "completion_length")):
    return all(a[k] == b[k] for k in keys)


@pytest.mark.parametrize("buffer", ["SSRReplayBuffer", "ReplayBuffer", "fill"])
def test_resume_reproduces_the_uninterrupted_run(cfg_factory, buffer):
    n = 3
    # "fill": SSR in fill mode with an age limit; its fresh batch spans the checkpoint (num_iterations 2)
    extra = (
        dict(replay_buffer_class="SSRReplayBuffer", ssr_mode="fill", ssr_max_age=2)
        if buffer == "fill"
        else dict(replay_buffer_class=buffer)
    )
    cfg = cfg_factory(**extra, max_steps=2 * n, save_steps=n, num_iterations=2)
    g.run(cfg)
    out = g.Path(cfg.output_dir)
    full = training_rows(out)
    ckpt = out / f"checkpoint-{n}"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    own = torch.load(ckpt / "rank-0.pt", weights_only=False)
    assert own["buffer"]["size"] > 0 and state["step"] == n  # the buffer's contents are in the checkpoint
    resumed = g.run(g.dataclasses.replace(cfg, resume_from_checkpoint=str(ckpt)))
    assert [r["step"] for r in resumed] == list(range(n + 1, 2 * n + 1))
    for a, b in zip(full[n:], resumed):
        assert _same(a, b), (a, b)
    assert [r["step"] for r in training_rows(out)] == list(range(1, 2 * n + 1))  # no step lost or repeated


@pytest.mark.slow
def test_resume_alone_continues_that_run(tmp_path, monkeypatch, capsys):
    out = tmp_path / "mine"
    settings = [
        "--output_dir",
        str(out),
        "--max_steps",
        "4",
        "--save_steps",
        "2",
        "--per_device_train_batch_size",
        "8",
        "--num_generations",
        "4",
        "--max_completion_length",
        "8",
        "--learning_rate",
        "0.003",
        "--seed",
        "5",
        "--replay_buffer_class",
        "uniform",
        "--device",
        "cpu",
    ]
    assert g.main(settings) == 0
    full = training_rows(out)
    monkeypatch.chdir(tmp_path)  # so that a resume which forgot its folder would write to ./runs/grpo_ssr
    assert g.main(["--resume_from_checkpoint", str(out / "checkpoint-2")]) == 0
    resumed = training_rows(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        assert a["reward"] == b["reward"] and a["loss"] == b["loss"] and a["learning_rate"] == b["learning_rate"]
    assert not (tmp_path / "runs").exists()
    # extending: allowed, with a note that the schedule changes
    capsys.readouterr()
    assert g.main(["--resume_from_checkpoint", "last", "--output_dir", str(out), "--max_steps", "6"]) == 0
    assert "note: --max_steps 6 differs from the checkpoint's 4" in capsys.readouterr().err
    assert [r["step"] for r in training_rows(out)] == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / "grpo_config.json").read_text())["learning_rate"] == 0.003


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert g.main(["--output_dir", str(out), "--save_steps", "1", "--learning_rate", "0.002", *SMALL]) == 0
    return out


@pytest.mark.parametrize(
    "flag,value,theirs",
    [
        ("--learning_rate", "0.5", "0.002"),
        ("--beta", "0.1", "0.0"),
        ("--replay_buffer_class", "SSRReplayBuffer", "'ReplayBuffer'"),
        ("--num_generations", "8", "4"),
    ],
)
def test_resume_refuses_a_conflicting_flag(finished_run, capsys, flag, value, theirs):
    before = (finished_run / "metrics.jsonl").read_text()
    assert g.main(["--resume_from_checkpoint", str(finished_run / "checkpoint-1"), flag, value]) == 2
    line = error_line(capsys)
    assert flag in line and f"checkpoint's {theirs}" in line
    assert (finished_run / "metrics.jsonl").read_text() == before


def test_resume_accepts_a_flag_equal_to_the_checkpoints(finished_run):
    cfg = g.resume_config(
        *g.parse_cli(
            [
                "--resume_from_checkpoint",
                str(finished_run / "checkpoint-1"),
                "--learning_rate",
                "0.002",
                "--save_steps",
                "5",
            ]
        )
    )
    assert cfg.learning_rate == 0.002 and cfg.save_steps == 5 and cfg.max_steps == 2
    # what counts as given: every spelling of a field's flag
    given = g.parse_cli(["--max-steps", "5", "--no_disable_dropout", "--beta=0.1"])[1]
    assert given == {"max_steps", "disable_dropout", "beta"}
    assert g.Path(cfg.output_dir).resolve() == finished_run.resolve()


def test_resume_into_another_runs_folder_is_refused(finished_run, tmp_path, capsys):
    other = tmp_path / "other"
    assert g.main(["--output_dir", str(other), *SMALL]) == 0
    before = (other / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert g.main(["--resume_from_checkpoint", str(finished_run / "checkpoint-1"), "--output_dir", str(other)]) == 2
    line = error_line(capsys)
    assert str(other) in line and str(finished_run.resolve()) in line
    assert (other / "metrics.jsonl").read_text() == before


# --- the CLI ----------------------------------------------------------------------------------------------------------


def test_unknown_flag_is_one_line_with_the_closest_name(capsys):
    assert g.main(["--num_generatons", "4"]) == 2
    assert error_line(capsys) == (
        "error: --num_generatons is not a field of GRPOConfig (python grpo_ssr.py --help "
        "lists them); did you mean --num_generations?"
    )


@pytest.mark.background(3, lambda folder, env: cli(["--help"], folder, timeout=120, env=env))
def test_help_lists_every_flag(background):
    out = background
    assert out.returncode == 0
    for f in g.dataclasses.fields(g.GRPOConfig):
        assert f"--{f.name}" in out.stdout, f.name
    assert "Completions per micro-batch" in out.stdout


def test_docstring_help_and_readme_tell_one_story():
    from transformers import HfArgumentParser

    help_text = " ".join(HfArgumentParser(g.GRPOConfig).format_help().split())  # what --help prints
    readme = " ".join((ROOT / "README.md").read_text().split())
    doc = " ".join(g.__doc__.split())
    assert "laptop" not in doc and "minute" not in help_text  # timings live beside the commands that measured them
    assert "TRL's default is 512" in help_text and "max_completion_length 512" in readme


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert g.main([*SMALL, "--output_dir", str(tmp_path / "notes.txt")]) == 2
    assert (
        error_line(capsys)
        == f"error: --output_dir {str(tmp_path / 'notes.txt')!r} is a file: name a folder (made if missing)"
    )
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_run_from_python_prints_the_start_line_the_command_line_prints(cfg_factory, capsys, keep_threads):
    g.GRPOTrainer(cfg_factory(max_steps=1, eval_steps=0)).train()
    from_python = capsys.readouterr().out.splitlines()[0]
    assert (
        g.main(
            ["--output_dir", str(cfg_factory().output_dir), "--overwrite_output_dir", "--max_steps", "1"]
            + ["--eval_steps", "0", "--per_device_train_batch_size", "8", "--num_generations", "4"]
            + ["--max_completion_length", "16", "--device", "cpu"]
        )
        == 0
    )
    from_cli = capsys.readouterr().out.splitlines()[0]
    assert from_python == from_cli
    assert from_cli.startswith("model tiny on cpu (float32); task builtin, reward reward_len; plain GRPO; 1 step(s)")


def test_the_summary_says_nothing_trained_rather_than_nan(capsys):
    rows = [{"step": i, "reward": 0.0, "frac_truncated": 0.0, "skipped": 1} for i in range(1, 4)]
    lines = g.summary_lines(rows, g.GRPOConfig(replay_buffer_class="ssr"))
    assert lines[1] == "replay (SSR, fill): nothing trained, so nothing was replayed"
    assert not any("nan" in line for line in lines)


def test_after_a_resume_the_closing_summary_covers_the_whole_run(cfg_factory, capsys, keep_threads):
    cfg = cfg_factory(max_steps=4, save_steps=2, eval_steps=0, replay_buffer_class="ssr")
    g.run(cfg)
    whole = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("training reward", "replay"))]
    g.run(g.dataclasses.replace(cfg, resume_from_checkpoint=str(g.Path(cfg.output_dir) / "checkpoint-2")))
    resumed = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("training reward", "replay"))]
    assert whole[0].endswith("(4 steps)") and resumed == whole  # steps 1-4, not only the resumed 3-4
