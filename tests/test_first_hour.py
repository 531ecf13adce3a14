"""A user's first hour (issue 16): nothing of theirs deleted, a resume that knows its run, mistakes as one line."""
import json
import re

import pytest

import grpo_ssr as g
from conftest import ROOT

SMALL = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
         "--max_completion_length", "8", "--device", "cpu"]


def _rows(path):
    """The training lines of a run's metrics.jsonl (held-out evaluation lines left out)."""
    return g.read_metrics(path / "metrics.jsonl")[0]


def _refuse(line):
    raise ValueError(f"not strict JSON: {line}")


def _error_line(capsys) -> str:
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def _files_save_pretrained_writes(tmp_path) -> set:
    model, tok = g.load_model("tiny")
    folder = tmp_path / "plain_save"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return {p.name for p in folder.iterdir()}


# --- never lose a user's data ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_overwrite_removes_only_what_the_run_wrote(tmp_path, capsys):
    out = tmp_path / "here"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    data = out / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}:"}) + "\n" for i in range(4)))
    args = ["--output_dir", str(out), "--dataset", str(data), *SMALL]
    assert g.main(args + ["--save_steps", "1"]) == 0
    written = set(json.loads((out / "model_files.json").read_text()))
    assert written == _files_save_pretrained_writes(tmp_path)  # the list is what save_pretrained really wrote
    assert written <= {p.name for p in out.iterdir()}
    capsys.readouterr()
    assert g.main(args) == 2 and "already holds a run" in _error_line(capsys)
    assert g.main(args + ["--overwrite_output_dir", "--max_steps", "1"]) == 0
    assert (out / "notes.txt").read_text() == "my notes" and data.is_file()
    assert [r["step"] for r in _rows(out)] == [1]  # the old run's lines are gone, not appended to
    assert not list(out.glob("checkpoint-*"))  # the old run's checkpoints went with it
    assert {p.name for p in out.iterdir()} == {"notes.txt", "prompts.jsonl", "metrics.jsonl", "grpo_config.json",
                                               "metrics.png", "model_files.json", *written}


def test_overwrite_refuses_to_remove_the_data_set_it_reads(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    data = out / "checkpoint-1" / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Say hi:"}) + "\n")
    assert g.main(["--output_dir", str(out), "--dataset", str(data), "--overwrite_output_dir", *SMALL]) == 2
    line = _error_line(capsys)
    assert "--overwrite_output_dir" in line and "checkpoint-1" in line
    assert data.is_file() and (out / "metrics.jsonl").is_file()  # nothing removed


def test_train_twice_in_one_folder_is_refused(cfg_factory):
    cfg = cfg_factory(max_steps=2)
    g.GRPOTrainer(cfg).train()
    with pytest.raises(g.ConfigError, match="already holds a run"):
        g.GRPOTrainer(cfg).train()
    assert [r["step"] for r in _rows(g.Path(cfg.output_dir))] == [1, 2]


@pytest.mark.slow
def test_save_total_limit_keeps_the_newest_checkpoints(cfg_factory):
    cfg = cfg_factory(max_steps=4, save_steps=1, save_total_limit=2)
    g.run(cfg)
    out = g.Path(cfg.output_dir)
    assert [p.name for p in g.checkpoints(out)] == ["checkpoint-3", "checkpoint-4"]
    assert g.find_last_checkpoint(out).name == "checkpoint-4"


def test_save_total_limit_must_be_positive(capsys):
    assert g.main(["--save_total_limit", "0", *SMALL]) == 2
    assert "--save_total_limit" in _error_line(capsys)


# --- a resume that knows its run ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_resume_alone_continues_that_run(tmp_path, monkeypatch, capsys):
    out = tmp_path / "mine"
    settings = ["--output_dir", str(out), "--max_steps", "4", "--save_steps", "2", "--per_device_train_batch_size",
                "8", "--num_generations", "4", "--max_completion_length", "8", "--learning_rate", "0.003",
                "--seed", "5", "--replay_buffer_class", "uniform", "--device", "cpu"]
    assert g.main(settings) == 0
    full = _rows(out)
    monkeypatch.chdir(tmp_path)  # so that a resume which forgot its folder would write to ./runs/grpo_ssr
    assert g.main(["--resume_from_checkpoint", str(out / "checkpoint-2")]) == 0
    resumed = _rows(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        assert a["reward"] == b["reward"] and a["loss"] == b["loss"] and a["learning_rate"] == b["learning_rate"]
    assert not (tmp_path / "runs").exists()
    # extending: allowed, with a note that the schedule changes
    capsys.readouterr()
    assert g.main(["--resume_from_checkpoint", "last", "--output_dir", str(out), "--max_steps", "6"]) == 0
    assert "note: --max_steps 6 differs from the checkpoint's 4" in capsys.readouterr().err
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / "grpo_config.json").read_text())["learning_rate"] == 0.003


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert g.main(["--output_dir", str(out), "--save_steps", "1", "--learning_rate", "0.002", *SMALL]) == 0
    return out


@pytest.mark.parametrize("flag,value,theirs", [("--learning_rate", "0.5", "0.002"), ("--beta", "0.1", "0.0"),
                                               ("--replay_buffer_class", "ReplayBuffer", "'SSRReplayBuffer'"),
                                               ("--num_generations", "8", "4")])
def test_resume_refuses_a_conflicting_flag(finished_run, capsys, flag, value, theirs):
    before = (finished_run / "metrics.jsonl").read_text()
    assert g.main(["--resume_from_checkpoint", str(finished_run / "checkpoint-1"), flag, value]) == 2
    line = _error_line(capsys)
    assert flag in line and f"checkpoint's {theirs}" in line
    assert (finished_run / "metrics.jsonl").read_text() == before


def test_resume_accepts_a_flag_equal_to_the_checkpoints(finished_run):
    cfg = g.parse_args(["--resume_from_checkpoint", str(finished_run / "checkpoint-1"), "--learning_rate", "0.002",
                        "--save_steps", "5"])
    assert cfg.learning_rate == 0.002 and cfg.save_steps == 5 and cfg.max_steps == 2
    assert g.Path(cfg.output_dir).resolve() == finished_run.resolve()


def test_resume_into_another_runs_folder_is_refused(finished_run, tmp_path, capsys):
    other = tmp_path / "other"
    assert g.main(["--output_dir", str(other), *SMALL]) == 0
    before = (other / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert g.main(["--resume_from_checkpoint", str(finished_run / "checkpoint-1"), "--output_dir", str(other)]) == 2
    line = _error_line(capsys)
    assert str(other) in line and str(finished_run.resolve()) in line
    assert (other / "metrics.jsonl").read_text() == before


# --- every mistake a one-line error ------------------------------------------------------------------------------

def test_unknown_flag_is_one_line_with_the_closest_name(capsys):
    with pytest.raises(SystemExit) as e:
        g.main(["--num_generatons", "4"])
    assert e.value.code == 2
    line = _error_line(capsys)
    assert "--num_generatons" in line and "did you mean --num_generations?" in line


def test_model_folder_that_is_missing_or_empty(tmp_path, capsys):
    assert g.main(["--model", "./nonexistent_dir", "--output_dir", str(tmp_path / "o"), *SMALL]) == 2
    assert "'./nonexistent_dir': no such folder" in _error_line(capsys)
    (tmp_path / "empty").mkdir()
    assert g.main(["--model", str(tmp_path / "empty"), "--output_dir", str(tmp_path / "o"), *SMALL]) == 2
    assert "the folder is empty" in _error_line(capsys)


@pytest.mark.parametrize("prompts,message", [
    (["Say hi:", ""], "row 1 (counting from 0): the prompt is empty"),
    (["Say hi:", 7], "row 1 (counting from 0): the prompt must be a string or a list of"),
    (["Say hi:", {"text": "hi"}], "row 1 (counting from 0): the prompt must be a string"),
    ([[{"role": "user", "content": "hi"}], "Say hi:"], "row 1 (counting from 0): mixes chat and plain-text"),
])
def test_bad_prompts_are_refused_naming_the_row(tmp_path, capsys, prompts, message):
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"prompt": p} for p in prompts]))
    assert g.main(["--dataset", str(data), "--output_dir", str(tmp_path / "o"), *SMALL]) == 2
    line = _error_line(capsys)
    assert message in line and str(data) in line


def test_dotted_reward_path_from_the_cli(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_rewards.py").write_text("def shortest(completions, **kw):\n"
                                            "    return [-float(len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "o"
    assert g.main(["--reward_funcs", "my_rewards.shortest,reward_len", "--output_dir", str(out), *SMALL]) == 0
    rows = _rows(out)
    assert "rewards/shortest" in rows[0] and "rewards/reward_len" in rows[0]
    capsys.readouterr()
    assert g.main(["--reward_funcs", "no_such_module.f", "--output_dir", str(tmp_path / "p"), *SMALL]) == 2
    line = _error_line(capsys)
    assert "--reward_funcs 'no_such_module.f' could not be imported" in line and "No module named" in line


# --- the Python API, as a TRL user calls it ----------------------------------------------------------------------

@pytest.mark.slow
def test_python_api_as_a_trl_user_calls_it(tmp_path):
    from datasets import Dataset

    data = Dataset.from_list([{"question": f"Summarise post {i}:", "label": float(i)} for i in range(4)])

    def by_label(completions, label, **kw):
        return label

    def length(completions, **kw):
        return [float(len(c)) for c in completions]

    cfg = g.GRPOConfig(output_dir=str(tmp_path / "api"), prompt_column="question", reward_weights=[1.0, 0.5],
                       max_steps=1, per_device_train_batch_size=8, num_generations=4, max_completion_length=8)
    model, tok = g.load_model("tiny")
    with pytest.raises(g.ConfigError, match="model= and tokenizer= together"):
        g.GRPOTrainer(cfg, model=model, reward_funcs=[by_label, length], dataset=data)
    trainer = g.GRPOTrainer(cfg, model=model, tokenizer=tok, reward_funcs=[by_label, length], dataset=data)
    assert trainer.dataset[0]["prompt"] == "Summarise post 0:"
    trainer.generate_batch()
    m = trainer.last_gen_metrics
    assert m["reward"] == pytest.approx(m["rewards/by_label"] + 0.5 * m["rewards/length"], rel=1e-5)
    trainer.train()
    saved = json.loads((tmp_path / "api" / "grpo_config.json").read_text())
    assert saved["reward_funcs"] == "passed from Python: by_label,length"
    assert saved["model"] == "passed from Python: Qwen2ForCausalLM"
    assert saved["dataset"] == "passed from Python: 4 rows" and saved["reward_weights"] == [1.0, 0.5]
    with pytest.raises(g.ConfigError, match="prompt is empty"):
        g.GRPOTrainer(g.dataclasses.replace(cfg, output_dir=str(tmp_path / "x")), dataset=[{"question": ""}],
                      reward_funcs=[by_label, length])


# --- what a user wants to see ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_log_completions_writes_the_batch_and_prints_a_few(tmp_path, capsys):
    out = tmp_path / "o"
    assert g.main(["--output_dir", str(out), "--log_completions", "--num_completions_to_print", "3",
                   "--logging_steps", "2", *SMALL[2:], "--max_steps", "4"]) == 0
    printed = capsys.readouterr().out
    logged = [json.loads(line) for line in open(out / "completions.jsonl")]
    metrics = _rows(out)
    assert [r["step"] for r in logged] == [2] * 8 + [4] * 8  # every logging step, the whole batch
    for step in (2, 4):
        batch = [r for r in logged if r["step"] == step]
        assert all(r["reward"] == g.reward_len([r["completion"]])[0] == r["rewards/reward_len"] for r in batch)
        assert sum(r["reward"] for r in batch) / 8 == pytest.approx(metrics[step - 1]["reward"], rel=1e-6)
        for group in range(2):
            assert sum(r["advantage"] for r in batch[4 * group:4 * group + 4]) == pytest.approx(0, abs=1e-4)
        assert len(set(r["prompt"] for r in batch[:4])) == 1
    assert len(re.findall(r"^  step \d+  reward", printed, flags=re.M)) == 6
    assert f"metrics: {out / 'metrics.jsonl'}" in printed and f"completions: {out / 'completions.jsonl'}" in printed
    assert f"model and tokenizer: {out}/" in printed


def test_completions_are_off_by_default_and_the_end_says_where_things_are(tmp_path, capsys):
    out = tmp_path / "o"
    assert g.main(["--output_dir", str(out), *SMALL]) == 0
    assert not (out / "completions.jsonl").exists()
    printed = capsys.readouterr().out
    assert f"model and tokenizer: {out}/" in printed and f"metrics: {out / 'metrics.jsonl'}" in printed
    assert f"picture: {out / 'metrics.png'}" in printed and (out / "metrics.png").is_file()
    (out / "metrics.png").unlink()  # no picture (matplotlib missing): the end does not point at one
    g.print_outputs(out)
    assert "picture" not in capsys.readouterr().out


def test_metrics_are_strict_json(cfg_factory):
    def unscored(completions, **kw):
        return [None] * len(completions)

    cfg = cfg_factory(max_steps=2)
    g.run(cfg, reward_funcs=[unscored, g.reward_len])
    lines = open(g.Path(cfg.output_dir) / "metrics.jsonl").read().splitlines()
    rows = [json.loads(line, parse_constant=_refuse) for line in lines]  # every line, evaluation lines too
    rows = [r for r in rows if "eval_reward" not in r]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["rewards/unscored"] is None


# --- one story -------------------------------------------------------------------------------------------------

def test_docstring_help_and_readme_tell_one_story():
    help_text = " ".join(g._parser().format_help().split())
    readme = " ".join((ROOT / "README.md").read_text().split())
    doc = " ".join(g.__doc__.split())
    phrase = "under a minute on a 2-core CPU"
    assert phrase in doc and phrase in help_text and phrase in readme
    assert "half a minute" not in doc and "2 CPU minutes" not in help_text
    assert "TRL's default is 512" in help_text and "max_completion_length 512" in readme
    actions = {s: a for a in g._parser()._actions for s in a.option_strings}
    assert actions["--scale_rewards"].help != actions["--no_scale_rewards"].help
    assert "Dr. GRPO" in actions["--no_scale_rewards"].help
