"""A TRL user's first hour (issue 21): TRL's call shape and its quick start offline, config values checked once, a
crashed run that does not lock its folder, Ctrl-C from Python, replay shown at the end, and threads set in one place."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from contextlib import contextmanager

import pytest
import torch

import grpo_ssr as g
from conftest import ROOT

SMALL = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
         "--max_completion_length", "8", "--device", "cpu"]


def _error_line(capsys) -> str:
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def _lines(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def keep_threads():
    """Trainers of the tiny model set torch's thread count: leave the rest of the suite as it was."""
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny model and tokenizer as save_pretrained writes them: what a Hub id or a folder loads."""
    folder = tmp_path_factory.mktemp("tiny") / "model"
    torch.manual_seed(0)
    model, tok = g.load_model("tiny")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# --- 1. threads, in one place ------------------------------------------------------------------------------------

def test_threads_default_to_one_for_the_tiny_model_and_are_recorded(cfg_factory, tmp_path, keep_threads):
    torch.set_num_threads(2)
    trainer = g.GRPOTrainer(cfg_factory())
    assert torch.get_num_threads() == 1 and trainer.record["num_threads"] == 1
    trainer = g.GRPOTrainer(cfg_factory(num_threads=2, output_dir=str(tmp_path / "two")))
    assert torch.get_num_threads() == 2 and trainer.record["num_threads"] == 2
    model, tok = g.load_model("tiny")  # a model passed from Python keeps torch's setting
    torch.set_num_threads(2)
    trainer = g.GRPOTrainer(cfg_factory(output_dir=str(tmp_path / "obj")), model=model, tokenizer=tok)
    assert torch.get_num_threads() == 2 and trainer.record["num_threads"] == 2
    assert g.parse_args(["--num_threads", "3"]).num_threads == 3
    with pytest.raises(g.ConfigError, match="--num_threads 0"):
        g.GRPOTrainer(cfg_factory(num_threads=0))


def test_busy_cpu_hint_names_the_thread_count_that_fits():
    assert g.busy_cpu_hint(2, 2, 0) is None  # a quiet machine
    assert g.busy_cpu_hint(1, 2, 5) is None  # one thread waits for no other
    assert g.busy_cpu_hint(2, 2, None) is None  # nothing known (no /proc/loadavg)
    assert g.busy_cpu_hint(2, 4, 2) is None  # the threads still fit
    hint = g.busy_cpu_hint(2, 2, 1)
    assert "1 other task(s) running on its 2 core(s)" in hint and hint.endswith("--num_threads 1 avoids that")
    assert g.busy_cpu_hint(8, 8, 3).endswith("--num_threads 5 avoids that")
    assert g.busy_cpu_hint(4, 2, 6).endswith("--num_threads 1 avoids that")


@contextmanager
def cpu_bound_neighbour():
    """Another process that keeps one core busy for the block's length, as another job on a shared machine would."""
    if g.other_busy_tasks() is None:
        pytest.skip("counts the running tasks in Linux's /proc/loadavg, on a process free to use every CPU")
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        neighbour.kill()
        neighbour.wait()


def test_a_cpu_bound_neighbour_is_counted_and_warned_of(keep_threads, monkeypatch):
    with cpu_bound_neighbour():
        assert g.other_busy_tasks() >= 1
    monkeypatch.setattr(g.os, "cpu_count", lambda: g.usable_cpus() + 2)  # pinned to some of the CPUs: no count
    assert g.other_busy_tasks() is None
    monkeypatch.setattr(g, "usable_cpus", lambda: 2)
    monkeypatch.setattr(g, "other_busy_tasks", lambda: 1)
    with pytest.warns(UserWarning, match="the CPU is busy: 1 other task.*--num_threads 1 avoids that"):
        g.pick_device("cpu", num_threads=2)

    def unread():
        raise AssertionError("one thread never reads the load")

    monkeypatch.setattr(g, "other_busy_tasks", unread)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g.pick_device("cpu", num_threads=1)


def test_on_the_command_line_the_busy_warning_is_one_line(tmp_path):
    """Beside a CPU-bound process, a run with a thread per core prints one `warning:` line, not Python's two
    (file:line, then the source line that raised it)."""
    with cpu_bound_neighbour():
        proc = subprocess.run([sys.executable, str(ROOT / "grpo_ssr.py"), *SMALL, "--max_steps", "1",
                               "--num_threads", str(g.usable_cpus()), "--output_dir", str(tmp_path / "o")],
                              capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    busy = [i for i, line in enumerate(lines) if "the CPU is busy" in line]
    assert len(busy) == 1 and lines[busy[0]].startswith("warning: the CPU is busy: ")
    assert "pick_device" not in proc.stderr and "UserWarning" not in proc.stderr


# --- 2. TRL's call shape -----------------------------------------------------------------------------------------

def reward_len(completions, **kwargs):  # TRL's quick-start reward, as its README writes it: ints
    return [-abs(20 - len(completion)) for completion in completions]


def test_trl_call_shape_trains_saves_and_keeps_a_log_history(cfg_factory, tiny_folder, tmp_path, keep_threads):
    from datasets import Dataset

    train = Dataset.from_list([{"prompt": f"POST {i}\nTL;DR:", "completion": "short"} for i in range(8)])
    held_out = Dataset.from_list([{"prompt": f"Held-out {i}\nTL;DR:"} for i in range(2)])
    tok = g.load_model("tiny")[1]
    args = cfg_factory(max_steps=2, eval_steps=1)
    trainer = g.GRPOTrainer(model=str(tiny_folder), reward_funcs=reward_len, args=args, train_dataset=train,
                            eval_dataset=held_out, processing_class=tok)
    assert trainer.args is trainer.cfg and trainer.processing_class is tok
    assert trainer.record["model"] == str(tiny_folder)  # a name a resume can load, not "passed from Python"
    trainer.train()
    out = g.Path(args.output_dir)
    history = trainer.state.log_history
    assert [json.loads(g.json_line(r)) for r in history] == _lines(out)  # NaN is null in the file
    assert [("eval" if "eval_reward" in r else "train", r["step"]) for r in history] == \
        [("eval", 0), ("train", 1), ("eval", 1), ("train", 2), ("eval", 2)]
    assert trainer.state.global_step == trainer.state.max_steps == 2
    trainer.save_model(str(tmp_path / "saved"))
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), trainer.model.state_dict().values()))
    assert (tmp_path / "saved" / "tokenizer.json").is_file()


def test_trl_positional_order_takes_args_third_and_names_the_rest(cfg_factory, tiny_folder, keep_threads):
    """TRL's signature is GRPOTrainer(model, reward_funcs, args, train_dataset, ...). Its third positional argument is
    the config here too; a fourth is refused in one line that says to name it, not read as a model."""
    from datasets import Dataset

    args = cfg_factory(max_steps=1)
    trainer = g.GRPOTrainer(str(tiny_folder), reward_len, args)
    assert trainer.cfg.max_steps == 1 and trainer.cfg.model == str(tiny_folder) and trainer.reward_weights == [1.0]
    data = Dataset.from_list([{"prompt": f"POST {i}\nTL;DR:"} for i in range(8)])
    with pytest.raises(g.ConfigError, match="only .model, reward_funcs, args. may be positional here: pass "
                                            "train_dataset="):
        g.GRPOTrainer(str(tiny_folder), reward_len, args, data)


def test_a_model_object_without_processing_class_gets_the_tokenizer_saved_with_it(cfg_factory, tiny_folder, tmp_path,
                                                                                  keep_threads):
    """TRL's rule: with no processing_class, the tokenizer comes from where the model was loaded from
    (model.config._name_or_path). A model built in code has no such place and is refused in one line."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    trainer = g.GRPOTrainer(model, reward_len, args=cfg_factory(max_steps=1))
    assert trainer.tokenizer.get_vocab() == g.load_model("tiny")[1].get_vocab()
    assert trainer.train()[-1]["step"] == 1
    built = g.build_tiny_model(len(g.build_tiny_tokenizer()))
    with pytest.raises(g.ConfigError, match="pass tokenizer= .processing_class= in TRL's words. with this model"):
        g.GRPOTrainer(built, reward_len, args=cfg_factory(output_dir=str(tmp_path / "built")))
    bare = tmp_path / "weights_only"
    model.save_pretrained(bare)  # no tokenizer files beside the weights
    with pytest.raises(g.ConfigError, match="no tokenizer= .processing_class=. was passed, and none could be loaded "
                                            ".*holds none of tokenizer.json"):
        g.GRPOTrainer(AutoModelForCausalLM.from_pretrained(bare), reward_len,
                      args=cfg_factory(output_dir=str(tmp_path / "bare")))
    # AutoTokenizer would build a 1-token tokenizer from that folder without a word; --model refuses it too
    with pytest.raises(g.ConfigError, match="the folder holds no tokenizer"):
        g.load_model(str(bare))


def test_reward_funcs_as_one_function_a_name_or_a_list_of_both(cfg_factory, tmp_path, monkeypatch, keep_threads):
    (tmp_path / "my_rewards.py").write_text("def shortest(completions, **kw):\n"
                                            "    return [-float(len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    one = g.GRPOTrainer(args=cfg_factory(), reward_funcs=reward_len)
    assert one.reward_funcs == [reward_len]
    named = g.GRPOTrainer(args=cfg_factory(), reward_funcs="reward_len_binary")
    assert named.reward_funcs == [g.reward_len_binary] and named.cfg.reward_funcs == "reward_len_binary"
    both = g.GRPOTrainer(args=cfg_factory(), reward_funcs=["my_rewards.shortest", reward_len])
    assert [g.func_name(f) for f in both.reward_funcs] == ["shortest", "reward_len"]
    assert both.record["reward_funcs"] == "passed from Python: shortest,reward_len"
    positional = g.GRPOTrainer("tiny", reward_len, args=cfg_factory())  # TRL's order: model, reward_funcs
    assert positional.cfg.model == "tiny" and positional.reward_funcs == [reward_len]


@pytest.mark.parametrize("kwargs,message", [
    (dict(peft_config=object()), "peft_config is not supported: PEFT is left out"),
    (dict(callbacks=[]), "callbacks is not supported"),
    (dict(args="both"), "pass cfg= or args="),
    (dict(train_dataset=[{"prompt": "a"}], dataset=[{"prompt": "b"}]), "pass dataset= or train_dataset="),
])
def test_trl_arguments_this_trainer_lacks_are_one_line(cfg_factory, kwargs, message):
    with pytest.raises(g.ConfigError, match=message) as e:
        g.GRPOTrainer(cfg_factory(), reward_funcs=reward_len, **kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name,value,advice", [
    ("num_train_epochs", 1, "grpo_ssr counts optimizer steps; use max_steps"),
    ("report_to", "wandb", "metrics.jsonl"),
    ("logging_dir", "logs", "use output_dir"),
    ("gradient_checkpointing", True, "per_device_train_batch_size"),
    ("use_vllm", True, "not vLLM"),
    ("vllm_server_host", "0.0.0.0", "TRL's GRPOConfig has it, grpo_ssr does not"),
    ("top_k", 50, "use temperature"),
    ("tf32", True, "transformers' TrainingArguments has it, grpo_ssr does not"),
])
def test_trl_config_fields_this_file_lacks_are_refused_naming_what_to_use(name, value, advice):
    with pytest.raises(g.ConfigError) as e:
        g.GRPOConfig(output_dir="x", **{name: value})
    assert str(e.value).startswith(f"{name} is not supported: ") and advice in str(e.value)
    assert "\n" not in str(e.value)


def test_cli_says_the_same_and_suggests_no_lookalike_flag(capsys):
    assert g.main(["--num_train_epochs", "1", *SMALL]) == 2
    line = _error_line(capsys)
    assert line == "error: --num_train_epochs is not supported: grpo_ssr counts optimizer steps; use max_steps"
    assert g.main(["--num-train-epochs=1", *SMALL]) == 2 and "use max_steps" in _error_line(capsys)
    with pytest.raises(g.ConfigError, match="GRPOConfig has no option 'max_stepz'; did you mean max_steps"):
        g.GRPOConfig(max_stepz=3)


QUICK_START = '''\
from datasets import load_dataset
from grpo_ssr import GRPOConfig, GRPOTrainer
dataset = load_dataset("trl-lib/tldr", split="train")
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]
trainer = GRPOTrainer(model="Qwen/Qwen2-0.5B-Instruct", reward_funcs=reward_len, train_dataset=dataset)
trainer.train()
'''

SEED_EXAMPLE = '''\
from datasets import load_dataset
from grpo_ssr import GRPOConfig, GRPOTrainer

dataset = load_dataset("trl-lib/tldr", split="train")


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


training_args = GRPOConfig(output_dir="Qwen2-0.5B-GRPO", logging_steps=10, replay_buffer_class="SSRReplayBuffer",
                           ssr_capacity_scalar=4, ssr_alpha=1.0)
trainer = GRPOTrainer(model="Qwen/Qwen2-0.5B-Instruct", reward_funcs=reward_len, args=training_args,
                      train_dataset=dataset)
trainer.train()
'''


@pytest.fixture(scope="module")
def offline_hub(tmp_path_factory, tiny_folder):
    """An HF_HOME in which "Qwen/Qwen2-0.5B-Instruct" and "trl-lib/tldr" resolve offline, to local stand-ins.

    The model: a Hub-cache snapshot (models--Qwen--Qwen2-0.5B-Instruct/snapshots/<commit>/ and refs/main) holding the
    tiny model, which from_pretrained reads with HF_HUB_OFFLINE=1. The data set: offline, load_dataset reads a data
    set it prepared once before, from HF_DATASETS_CACHE/trl-lib___tldr/default/0.0.0/<commit>/; the stand-in is
    prepared there by the parquet builder an online load would use, from a parquet file with tldr's columns (prompt,
    completion) holding grpo_ssr's 36 built-in TL;DR-style prompts."""
    from datasets import Dataset
    from datasets.packaged_modules.parquet.parquet import Parquet

    home, commit = tmp_path_factory.mktemp("hf_home"), "0" * 39 + "1"
    repo = home / "hub" / "models--Qwen--Qwen2-0.5B-Instruct"
    shutil.copytree(tiny_folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    parquet = home / "train.parquet"
    Dataset.from_list([{**r, "completion": " A short summary."} for r in g.builtin_prompts()]).to_parquet(parquet)
    build = home / "build"
    Parquet(cache_dir=str(build), dataset_name="tldr", config_name="default", hash=commit,
            data_files={"train": str(parquet)}).download_and_prepare()
    prepared = next((build / "tldr").glob("default*"))  # its config id hashes the local file's path
    shutil.move(str(prepared), str(home / "datasets" / "trl-lib___tldr" / "default"))
    for lock in (home / "datasets").rglob("*.lock"):
        lock.unlink()
    return home


def _run_snippet(code: str, home, cwd):
    cwd.mkdir()
    (cwd / "snippet.py").write_text(code)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    env.pop("HF_HUB_CACHE", None), env.pop("HF_DATASETS_CACHE", None)
    return subprocess.run([sys.executable, "snippet.py"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_trl_quick_start_runs_offline_with_only_the_import_changed(offline_hub, tmp_path):
    """TRL's README quick start, its text unchanged but for the import: our defaults apply (250 steps, about a
    minute or two on 2 cores)."""
    proc = _run_snippet(QUICK_START, offline_hub, tmp_path / "quick")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "quick" / "runs" / "grpo_ssr"
    rows = [r for r in _lines(out) if "eval_reward" not in r]
    assert [r["step"] for r in rows] == list(range(1, 251))
    assert json.loads((out / "grpo_config.json").read_text())["model"] == "Qwen/Qwen2-0.5B-Instruct"
    assert (out / "model.safetensors").is_file() and "replay (SSR, fill) over 250 steps" in proc.stdout


@pytest.mark.slow
def test_the_seed_pull_requests_example_runs_with_only_the_import_changed(offline_hub, tmp_path):
    proc = _run_snippet(SEED_EXAMPLE, offline_hub, tmp_path / "seed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "seed" / "Qwen2-0.5B-GRPO"
    saved = json.loads((out / "grpo_config.json").read_text())
    assert saved["logging_steps"] == 10 and saved["replay_buffer_class"] == "SSRReplayBuffer"
    assert len([r for r in _lines(out) if "eval_reward" not in r]) == 250


# --- 3. settings accepted and silently wrong ---------------------------------------------------------------------

def test_scale_rewards_batch_by_hand_and_trls_words():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 8.0, 5.0, 5.0, 5.0, 5.0])
    # group means 2.5, 2 and 5; "batch" divides every group's centred rewards by one std, the whole batch's
    # (unbiased): mean 38/12, sum of squared deviations 73.6667, std sqrt(73.6667 / 11) = 2.587850
    mean = 38 / 12
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards.tolist()) / 11)
    assert std == pytest.approx(2.587850, abs=1e-6)
    centred = [-1.5, -0.5, 0.5, 1.5, -2.0, -2.0, -2.0, 6.0, 0.0, 0.0, 0.0, 0.0]
    batch = g.group_advantages(rewards, 4, "batch")
    assert torch.allclose(batch, torch.tensor([c / (std + 1e-4) for c in centred]), atol=1e-6)
    assert (batch[8:] == 0).all()  # a group with no spread stays exactly 0
    # True is "group" and False is "none", bit for bit
    assert torch.equal(g.group_advantages(rewards, 4, True), g.group_advantages(rewards, 4, "group"))
    assert torch.equal(g.group_advantages(rewards, 4, False), g.group_advantages(rewards, 4, "none"))
    assert g.group_advantages(rewards, 4, "none").tolist() == centred
    assert [g.GRPOConfig(scale_rewards=v).scale_rewards for v in (True, False, "none", "batch")] == \
        ["group", "none", "none", "batch"]


def test_scale_rewards_from_the_cli_and_through_a_step(cfg_factory, capsys, keep_threads):
    words = {"none": "none", "group": "group", "batch": "batch", "true": "group", "false": "none"}
    for word, meant in words.items():
        assert g.parse_args(["--scale_rewards", word]).scale_rewards == meant
    assert g.parse_args(["--no_scale_rewards"]).scale_rewards == "none"
    assert g.main(["--scale_rewards", "sometimes", *SMALL]) == 2
    assert "--scale_rewards 'sometimes' is invalid" in _error_line(capsys)
    trainer = g.GRPOTrainer(cfg_factory(scale_rewards="batch"))
    samples = trainer.generate_batch()
    rewards = torch.tensor([float(g.reward_len([trainer.tokenizer.decode(
        s["completion_ids"][s["completion_mask"].bool()], skip_special_tokens=True)])[0]) for s in samples])
    expected = g.group_advantages(rewards, 4, "batch")
    assert torch.allclose(torch.stack([s["advantages"] for s in samples]), expected, atol=1e-5)


@pytest.mark.parametrize("field,value,message", [
    ("max_steps", 2.5, "--max_steps 2.5 is invalid: must be an integer, not float"),
    ("max_steps", True, "--max_steps True is invalid: must be an integer, not bool"),
    ("learning_rate", "1e-5", "--learning_rate '1e-5' is invalid: must be a number, not str (write it without quotes)"),
    ("per_device_train_batch_size", 8.0, "--per_device_train_batch_size 8.0 is invalid: must be an integer"),
    ("bf16", "yes", "--bf16 'yes' is invalid: must be true or false"),
    ("ssr_max_age", 1.5, "--ssr_max_age 1.5 is invalid: must be an integer or None"),
    ("reward_weights", [1.0, "a"], "--reward_weights [1.0, 'a'] is invalid: must be a list of numbers"),
])
def test_every_value_is_type_checked_naming_the_field(field, value, message):
    with pytest.raises(g.ConfigError) as e:
        g.GRPOConfig(**{field: value})
    assert str(e.value) == message or str(e.value).startswith(message)


def test_a_reward_that_returns_strings_is_refused_naming_it(cfg_factory, keep_threads):
    def quoted(completions, **kw):
        return ["1"] * len(completions)

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[quoted])
    with pytest.raises(g.ConfigError, match="reward function 'quoted' returned a value that is not a number"):
        trainer.generate_batch()


def test_prompt_and_completion_must_fit_the_models_positions(cfg_factory, tmp_path, capsys, keep_threads):
    with pytest.raises(g.ConfigError, match=r"--max_prompt_length 512 \+ --max_completion_length 100000 = 100512 "
                                            r"exceeds the model's 1024 positions"):
        g.GRPOTrainer(cfg_factory(max_completion_length=100000))
    assert g.main([*SMALL, "--max_completion_length", "100000", "--output_dir", str(tmp_path / "o")]) == 2
    assert "1024 positions" in _error_line(capsys)
    g.GRPOTrainer(cfg_factory(max_prompt_length=960, max_completion_length=64))  # exactly 1024: fits


def test_the_record_says_float32_when_bf16_fell_back(cfg_factory, monkeypatch, keep_threads):
    monkeypatch.setattr(g, "cpu_has_bf16", lambda: False)
    with pytest.warns(UserWarning, match="running in float32"):
        trainer = g.GRPOTrainer(cfg_factory(bf16=True))
    assert trainer.record["bf16"] is False and trainer.record["precision"] == "float32"
    monkeypatch.setattr(g, "cpu_has_bf16", lambda: True)
    trainer = g.GRPOTrainer(cfg_factory(bf16=True))
    assert trainer.record["bf16"] is True and trainer.record["precision"] == "bf16 autocast"


# --- 4. a crashed run does not lock its own folder ---------------------------------------------------------------

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
    assert "holds a run that finished no step: starting over it" in capsys.readouterr().err
    assert [r["step"] for r in _lines(out) if "eval_reward" not in r] == [1, 2]
    assert (out / "notes.txt").read_text() == "mine"
    with pytest.raises(g.ConfigError, match="already holds a run; pass --overwrite_output_dir to replace it, or "
                                            "another --output_dir"):  # a real run: kept; no checkpoint to suggest
        g.GRPOTrainer(cfg)


def test_a_reward_with_the_wrong_count_is_one_line_and_the_fixed_command_runs(tmp_path, monkeypatch, capsys,
                                                                              keep_threads):
    (tmp_path / "bad_rewards.py").write_text("def short(completions, **kw):\n"
                                             "    return [0.0] * (len(completions) - 1)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TQDM_DISABLE", "1")  # the progress bar is not what is tested: stderr holds only the error
    args = ["--output_dir", str(tmp_path / "o"), "--eval_steps", "0", *SMALL]
    assert g.main(args + ["--reward_funcs", "bad_rewards.short"]) == 2
    assert _error_line(capsys) == ("error: reward function 'short' returned 7 values for 8 completions: return one "
                                   "number (or None) per completion")
    assert g.main(args) == 0


# --- 5. Ctrl-C from Python ---------------------------------------------------------------------------------------

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


def test_ctrl_c_from_the_cli_exits_0_with_its_resume_line(tmp_path, monkeypatch, capsys, keep_threads):
    (tmp_path / "sig_rewards.py").write_text(textwrap.dedent("""\
        import os, signal
        import grpo_ssr
        calls = []
        def ctrl_c(completions, **kw):
            calls.append(1)
            if len(calls) == 1:
                os.kill(os.getpid(), signal.SIGINT)
            return grpo_ssr.reward_len(completions)
        """))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "o"
    assert g.main(["--output_dir", str(out), "--eval_steps", "0", "--reward_funcs", "sig_rewards.ctrl_c", *SMALL]) == 0
    assert f"resume with --resume_from_checkpoint {out / 'checkpoint-1'}" in capsys.readouterr().err


def test_a_half_written_checkpoint_is_cleaned_away_on_the_next_start(cfg_factory, keep_threads):
    cfg = cfg_factory(max_steps=2, save_steps=2)
    g.run(cfg)
    out = g.Path(cfg.output_dir)
    (out / ".tmp-checkpoint-7").mkdir()  # what a second Ctrl-C during a save leaves (os._exit)
    (out / ".tmp-checkpoint-7" / "model.safetensors").write_text("half")
    g.run(g.dataclasses.replace(cfg, resume_from_checkpoint="last", max_steps=3))
    assert not (out / ".tmp-checkpoint-7").exists()
    assert [r["step"] for r in _lines(out) if "eval_reward" not in r] == [1, 2, 3]


# --- 6. the main job shows replay at work ------------------------------------------------------------------------

def test_the_end_of_a_run_says_what_replay_did(tmp_path, capsys, keep_threads):
    assert g.main(["--output_dir", str(tmp_path / "o"), *SMALL]) == 0
    printed = [l for l in capsys.readouterr().out.splitlines() if l.startswith("replay ")]
    assert len(printed) == 1 and printed[0].startswith("replay (SSR, fill) over 2 steps: ")
    assert "replay_frac" in printed[0] and "no reward spread" in printed[0]
    cfg = g.GRPOConfig()
    idle = g.replay_summary([{"replay_frac": 0.0, "frac_zero_adv_trained": 0.0, "frac_reward_zero_std": 0.0}] * 4, cfg)
    assert "over 4 steps: 0.0% of trained samples replayed" in idle
    assert "python grpo_ssr.py --reward_funcs reward_len_binary" in idle
    busy = g.replay_summary([{"replay_frac": 0.4, "frac_zero_adv_trained": 0.0, "frac_reward_zero_std": 0.5}], cfg)
    assert "40.0% of trained samples replayed" in busy and "50.0% of groups" in busy and "reward_len_binary" not in busy
    plain = g.replay_summary([{"replay_frac": 0.0}], g.GRPOConfig(replay_buffer_class="ReplayBuffer"))
    assert plain.startswith("replay (uniform buffer: plain GRPO)") and "reward_len_binary" not in plain


def test_metrics_figure_has_a_replay_panel_a_title_and_smoothed_lines(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    rows = [{"step": s, "reward": -30 + s + (-1) ** s * 3, "replay_frac": 0.5 + (-1) ** s * 0.1,
             "frac_zero_adv_trained": 0.1, "frac_reward_zero_std": 0.3, "clip_ratio": 0.0, "completion_length": 9}
            for s in range(1, 41)]
    rows.insert(0, {"step": 0, "eval_reward": -30.0, "eval_greedy_reward": -31.0})
    (out / "metrics.jsonl").write_text("".join(g.json_line(r) for r in rows))
    (out / "grpo_config.json").write_text(json.dumps({**g.dataclasses.asdict(g.GRPOConfig()), "model": "tiny"}))
    fig = g.metrics_figure(out)
    assert fig.get_suptitle() == "model tiny   reward reward_len   buffer SSRReplayBuffer (fill)"
    by_title = {ax.get_title(): ax for ax in fig.axes}
    replay = next(ax for title, ax in by_title.items() if title.startswith("replay"))
    labels = [line.get_label() for line in replay.get_lines()]
    assert "replay_frac" in labels and "frac_zero_adv_trained" in labels
    raw, smoothed = [line.get_ydata() for line in by_title["training reward (generation batch)"].get_lines()]
    assert len(raw) == len(smoothed) == 40 and max(abs(a - b) for a, b in zip(raw, smoothed)) > 1
    assert max(smoothed[2:]) - min(smoothed[2:]) < max(raw) - min(raw)  # the zig-zag is averaged out
    assert g.plot_metrics(out) == out / "metrics.png" and (out / "metrics.png").stat().st_size > 0


# --- 7. a malformed .jsonl says where ----------------------------------------------------------------------------

def test_a_malformed_jsonl_names_the_file_and_the_line(tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"} trailing\n{"prompt": "d"}\n')
    assert g.main(["--dataset", str(data), "--output_dir", str(tmp_path / "o"), *SMALL]) == 2
    line = _error_line(capsys)
    assert str(data) in line and "line 3 is not valid JSON" in line
    doc = tmp_path / "prompts.json"
    doc.write_text('[\n  {"prompt": "a"},\n  {"prompt": "b"}\n  {"prompt": "c"}\n]\n')  # a missing comma, line 4
    assert g.main(["--dataset", str(doc), "--output_dir", str(tmp_path / "o"), *SMALL]) == 2
    assert "line 4 is not valid JSON" in _error_line(capsys)
