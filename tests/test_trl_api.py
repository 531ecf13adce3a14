"""TRL's call shape (issue 21, a TRL user's first hour): GRPOTrainer(model, reward_funcs, args, ...) with a model name,
folder or object, its log history and save_model, reward functions as TRL passes them, TRL's arguments and config
fields that this file lacks refused in one line (the closest field named), and TRL's quick start and the seed pull
request's example run offline with only the import changed. (The rest of that hour lives by subject: threads in
test_threads.py, config values, a crashed run, Ctrl-C and the end-of-run replay summary in test_run_and_resume.py,
scale_rewards and rewards that return strings in test_rewards_and_advantages.py, a malformed .jsonl in
test_models_and_data.py.) The two scripts, and the offline stand-ins for the Hub they run against, are in conftest.py
with the suite's other long runs."""

import json

import pytest
import torch

import grpo_ssr as g
from conftest import SMALL, error_line, metrics_rows


def reward_len(completions, **kwargs):  # TRL's quick-start reward, as its README writes it: ints
    return [-abs(20 - len(completion)) for completion in completions]


def test_trl_call_shape_trains_saves_and_keeps_a_log_history(cfg_factory, tiny_folder, tmp_path, keep_threads):
    from datasets import Dataset

    train = Dataset.from_list([{"prompt": f"POST {i}\nTL;DR:", "completion": "short"} for i in range(8)])
    held_out = Dataset.from_list([{"prompt": f"Held-out {i}\nTL;DR:"} for i in range(2)])
    tok = g.load_model("tiny")[1]
    args = cfg_factory(max_steps=2, eval_steps=1)
    trainer = g.GRPOTrainer(
        model=str(tiny_folder),
        reward_funcs=reward_len,
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
        processing_class=tok,
    )
    assert trainer.args is trainer.cfg and trainer.processing_class is tok
    assert trainer.record_of_run["model"] == str(tiny_folder)  # a name a resume can load, not "passed from Python"
    trainer.train()
    out = g.Path(args.output_dir)
    history = trainer.state.log_history
    assert [json.loads(g.json_line(r)) for r in history] == metrics_rows(out)  # NaN is null in the file
    assert [("eval" if "eval_reward" in r else "train", r["step"]) for r in history] == [
        ("eval", 0),
        ("train", 1),
        ("eval", 1),
        ("train", 2),
        ("eval", 2),
    ]
    assert trainer.state.global_step == trainer.state.max_steps == 2
    trainer.save_model(str(tmp_path / "saved"))
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), trainer.model.state_dict().values()))
    assert (tmp_path / "saved" / "tokenizer.json").is_file()


def test_trl_positional_order_takes_args_third_and_names_the_rest(cfg_factory, tiny_folder, keep_threads):
    """TRL's signature is GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class):
    the same order here."""
    from datasets import Dataset

    args = cfg_factory(max_steps=1, eval_steps=50)  # eval_dataset is scored only with eval_steps
    trainer = g.GRPOTrainer(str(tiny_folder), reward_len, args)
    assert trainer.cfg.max_steps == 1 and trainer.cfg.model == str(tiny_folder) and trainer.reward_weights == [1.0]
    data = Dataset.from_list([{"prompt": f"POST {i}\nTL;DR:"} for i in range(8)])
    tok = g.load_model("tiny")[1]
    trainer = g.GRPOTrainer(str(tiny_folder), reward_len, args, data, data.select(range(2)), tok)
    assert [r["prompt"] for r in trainer.dataset] == data["prompt"] and len(trainer.eval_rows) == 2
    assert trainer.tokenizer is tok


def test_a_model_object_needs_its_processing_class(cfg_factory, tiny_folder, tmp_path, keep_threads):
    """A model object comes with its tokenizer (processing_class=); without one it is refused in one line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    with pytest.raises(g.ConfigError, match="pass processing_class= .its tokenizer. with this model object"):
        g.GRPOTrainer(model, reward_len, args=cfg_factory(max_steps=1))
    trainer = g.GRPOTrainer(
        model, reward_len, args=cfg_factory(max_steps=1), processing_class=AutoTokenizer.from_pretrained(tiny_folder)
    )
    assert trainer.train()[-1]["step"] == 1
    bare = tmp_path / "weights_only"
    model.save_pretrained(bare)  # no tokenizer files beside the weights
    # AutoTokenizer would build a 1-token tokenizer from that folder without a word; --model refuses it
    with pytest.raises(g.ConfigError, match="the folder holds no tokenizer"):
        g.load_model(str(bare))


def test_reward_funcs_as_one_function_a_name_or_a_list_of_both(cfg_factory, tmp_path, monkeypatch, keep_threads):
    (tmp_path / "my_rewards.py").write_text(
        "def shortest(completions, **kw):\n    return [-float(len(c)) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    originals = lambda trainer: [f.func for f in trainer.reward_funcs]  # each is wrapped in a CheckedReward
    one = g.GRPOTrainer(args=cfg_factory(), reward_funcs=reward_len)
    assert originals(one) == [reward_len] and all(isinstance(f, g.CheckedReward) for f in one.reward_funcs)
    named = g.GRPOTrainer(args=cfg_factory(), reward_funcs="reward_len_binary")
    assert originals(named) == [g.reward_len_binary] and named.cfg.reward_funcs == "reward_len_binary"
    both = g.GRPOTrainer(args=cfg_factory(), reward_funcs=["my_rewards.shortest", reward_len])
    assert [f.__name__ for f in both.reward_funcs] == ["shortest", "reward_len"]
    assert both.record_of_run["reward_funcs"] == "passed from Python: shortest,reward_len"
    positional = g.GRPOTrainer("tiny", reward_len, args=cfg_factory())  # TRL's order: model, reward_funcs
    assert positional.cfg.model == "tiny" and originals(positional) == [reward_len]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(peft_config=object()), "got an unexpected keyword argument 'peft_config'"),  # Python's own TypeError
        (dict(callbacks=[]), "got an unexpected keyword argument 'callbacks'"),
        (dict(args="both"), "GRPOTrainer: pass the config once, as the first argument or as args="),
        (dict(dataset=[{"prompt": "b"}]), "got an unexpected keyword argument 'dataset'"),  # TRL's train_dataset= only
    ],
)
def test_trl_arguments_this_trainer_lacks_are_one_line(cfg_factory, kwargs, message):
    with pytest.raises((g.ConfigError, TypeError)) as e:
        g.GRPOTrainer(cfg_factory(), reward_funcs=reward_len, **kwargs)
    assert str(e.value).endswith(message) and "\n" not in str(e.value)


NOT_A_FIELD = "is not a field of GRPOConfig (python grpo_ssr.py --help lists them)"


@pytest.mark.parametrize(
    "name,value,closest",
    [  # one generic line; a suggestion only for a near-certain typo, never
        ("num_train_epochs", 1, None),  # a look-alike that means something else (num_iterations)
        ("report_to", "wandb", None),
        ("logging_dir", "logs", None),
        ("per_device_eval_batch_size", 8, None),
        ("num_generatons", 8, "num_generations"),
        ("gradient_checkpointing", True, None),
        ("use_vllm", True, None),
        ("vllm_server_host", "0.0.0.0", None),
        ("top_k", 50, None),
        ("tf32", True, None),
    ],
)
def test_trl_config_fields_this_file_lacks_are_refused_in_one_line(name, value, closest):
    with pytest.raises(g.ConfigError) as e:
        g.GRPOConfig(output_dir="x", **{name: value})
    assert str(e.value) == f"{name} {NOT_A_FIELD}" + (f"; did you mean {closest}?" if closest else "")


def test_cli_says_the_same_in_either_spelling(capsys):
    expected = f"error: --num_train_epochs {NOT_A_FIELD}"
    assert g.main(["--num_train_epochs", "1", *SMALL]) == 2
    assert error_line(capsys) == expected
    assert g.main(["--num-train-epochs=1", *SMALL]) == 2
    assert error_line(capsys) == expected
    assert g.main(["--report_to", "wandb", *SMALL]) == 2
    assert error_line(capsys) == f"error: --report_to {NOT_A_FIELD}"  # nothing close: no guess
    with pytest.raises(g.ConfigError) as e:
        g.GRPOConfig(max_stepz=3)
    assert str(e.value) == f"max_stepz {NOT_A_FIELD}; did you mean max_steps?"


@pytest.mark.slow
def test_trl_quick_start_runs_offline_with_only_the_import_changed(snippet_runs):
    """TRL's README quick start, its text unchanged but for the import: our defaults apply (250 steps)."""
    future, cwd = snippet_runs["quick"]
    proc = future.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = cwd / "runs" / "grpo_ssr"
    rows = [r for r in metrics_rows(out) if "eval_reward" not in r]
    assert [r["step"] for r in rows] == list(range(1, 251))
    assert json.loads((out / "grpo_config.json").read_text())["model"] == "Qwen/Qwen2-0.5B-Instruct"
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / "grpo_config.json").read_text())["replay_buffer_class"] == "ReplayBuffer"
    assert "replay (" not in proc.stdout  # plain GRPO, the default: no replay line


@pytest.mark.slow
def test_the_seed_pull_requests_example_runs_with_only_the_import_changed(snippet_runs):
    future, cwd = snippet_runs["seed"]
    proc = future.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = cwd / "Qwen2-0.5B-GRPO"
    saved = json.loads((out / "grpo_config.json").read_text())
    assert saved["logging_steps"] == 10 and saved["replay_buffer_class"] == "SSRReplayBuffer"
    assert len([r for r in metrics_rows(out) if "eval_reward" not in r]) == 250
