"""Models and data (Part II): the real loading path (a model folder from save_pretrained, a local .jsonl), dropout off
in the policy, the built-in and arithmetic tasks and their held-out splits, local files, chat prompts, and bad models,
files and rows refused with one line that names them."""

import json
import math
import re

import pytest
import torch

import grpo_ssr as g
from conftest import SMALL, cli, error_line

# --- models -----------------------------------------------------------------------------------------------------------


def test_real_loading_path_local_model_and_jsonl(tmp_path):
    """--model DIR (save_pretrained) and --dataset FILE.jsonl with another prompt column, whose other columns reach
    the reward function. (Chat prompts from a file: test_chat_prompts_use_the_chat_template.)"""
    torch.manual_seed(0)
    tok = g.build_tiny_tokenizer()
    g.build_tiny_model(len(tok)).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rows = [{"question": f"Summarise post {i}: the cat sat.", "label": i} for i in range(4)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = {}

    def reward_with_column(completions, prompts, label, **kw):
        seen["label"], seen["prompts"] = label, prompts
        return [float(l) for l in label]

    cfg = g.GRPOConfig(
        model=str(tmp_path / "model"),
        dataset=str(data),
        prompt_column="question",
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
    )
    history = g.run(cfg, reward_funcs=[reward_with_column])
    assert len(history) == 2
    assert len(seen["label"]) == 8 and seen["prompts"][0].startswith("Summarise post")
    assert seen["label"][:4] == [seen["label"][0]] * 4  # dataset columns are repeated per completion


def test_model_folder_that_is_missing_or_empty(tmp_path, capsys):
    assert g.main(["--model", "./nonexistent_dir", "--output_dir", str(tmp_path / "o"), *SMALL]) == 2
    assert "'./nonexistent_dir': no such folder" in error_line(capsys)
    (tmp_path / "empty").mkdir()
    assert g.main(["--model", str(tmp_path / "empty"), "--output_dir", str(tmp_path / "o"), *SMALL]) == 2
    assert "the folder holds no tokenizer" in error_line(capsys)


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=258,
            n_positions=128,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.3,
            embd_pdrop=0.3,
            attn_pdrop=0.3,
            bos_token_id=256,
            eos_token_id=256,
        )
    )


@pytest.mark.parametrize("disable", [True, False])
def test_dropout_is_disabled_in_the_policy(cfg_factory, disable):
    tok = g.build_tiny_tokenizer()
    trainer = g.GRPOTrainer(
        cfg_factory(disable_dropout=disable, max_prompt_length=64), model=_tiny_gpt2(), processing_class=tok
    )  # 64 + 16 tokens fit its 128 positions
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    trainer.model.train()
    with torch.no_grad():
        a, b = (g.per_token_logps(trainer.model, ids, torch.ones_like(ids), 6) for _ in range(2))
    assert torch.equal(a, b) is disable  # with dropout on, two training forwards differ


# --- the built-in and the arithmetic tasks, and their held-out splits -------------------------------------------------


def test_builtin_chat_is_the_same_posts_as_one_user_message_each():
    """The seed's job for an instruct model: the TL;DR posts through its chat template, as TRL's conversational sets."""
    for heldout in (False, True):
        plain, chat = g.builtin_prompts(heldout), g.load_prompts("builtin_chat", "test" if heldout else "train")
        assert [[{"role": "user", "content": r["prompt"]}] for r in plain] == [r["prompt"] for r in chat]


def test_builtin_held_out_posts_are_not_in_training():
    train, held = g.builtin_prompts(), g.builtin_prompts(heldout=True)
    assert len(train) == 36 and len(held) == 12
    for post in g.BUILTIN_HELDOUT_POSTS:
        assert not any(post in r["prompt"] for r in train)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert g.load_eval_prompts(g.GRPOConfig()) == held
    assert g.load_eval_prompts(g.GRPOConfig(dataset="some/hub-id")) is None  # no split to hold out


def _question(row) -> tuple[int, int]:
    a, _, b = row["prompt"][-1]["content"].rstrip(" =").partition(" + ")
    return int(a), int(b)


@pytest.mark.parametrize("name", ["arithmetic:1", "arithmetic:2", "arithmetic:3", "arithmetic", "arithmetic:1,2,3"])
def test_arithmetic_split_never_overlaps(name):
    levels = g.arithmetic_levels(name)
    train, held = g.arithmetic_prompts(levels), g.arithmetic_prompts(levels, heldout=True)
    pairs = lambda rows: {tuple(sorted(_question(r))) for r in rows}
    assert not pairs(train) & pairs(held)  # not even 3 + 4 against 4 + 3
    for level in levels:
        n_train = sum(r["level"] == level for r in train)
        n_held = sum(r["level"] == level for r in held)
        assert 95 <= n_train + n_held <= 102 and 0.25 <= n_held / (n_train + n_held) <= 0.35
    for r in train + held:
        a, b = _question(r)
        assert r["answer"] == a + b and r["prompt"][0] == {"role": "system", "content": g.ARITHMETIC_SYSTEM_PROMPT}
        (lo_a, hi_a), (lo_b, hi_b) = g.ARITHMETIC_LEVELS[r["level"]]
        assert (lo_a <= a <= hi_a and lo_b <= b <= hi_b) or (lo_a <= b <= hi_a and lo_b <= a <= hi_b)
    assert len({_question(r) for r in train}) == len(train)  # no question twice
    assert [r["level"] for r in held[: len(levels)]] == levels  # round-robin: the first prompts cover every level


def test_arithmetic_through_load_prompts_and_the_held_out_loader():
    cfg = g.GRPOConfig(dataset="arithmetic", eval_max_prompts=10, seed=7)
    train = g.load_prompts("arithmetic")
    held = g.load_eval_prompts(cfg)
    assert len(held) == 10 and held == g.arithmetic_prompts([1, 2], heldout=True)[:10]  # the same for every seed
    assert {r["level"] for r in train} == {1, 2} and len(train) == 140
    assert g.arithmetic_levels("arithmetic:4") is None and g.arithmetic_levels("arithmetic:x") is None


# --- local files, and the rows in them --------------------------------------------------------------------------------


def faulty_runs(folder, env) -> list:
    """Bad data files and a bad model, each on the command line: [(flags, the name its error must give, process)]."""
    empty = folder / "empty.jsonl"
    empty.write_text("")
    garbage = folder / "garbage.jsonl"
    garbage.write_text("{not json\n")
    nocol = folder / "nocol.jsonl"
    nocol.write_text(json.dumps({"text": "hi"}) + "\n")
    badmodel = folder / "model"
    badmodel.mkdir()
    (badmodel / "config.json").write_text("{}")
    cases = [
        (["--dataset", str(empty)], str(empty)),
        (["--dataset", str(garbage)], str(garbage)),
        (["--dataset", str(nocol)], "--prompt_column"),
        (["--dataset", str(folder / "nope.csv")], "nope.csv"),
        (["--model", str(badmodel)], str(badmodel)),
        (["--model", "no-such-org/no-such-model"], "no-such-org/no-such-model"),
    ]
    return [
        (flags, name, cli(flags + SMALL + ["--output_dir", str(folder / "o")], folder, env=env))
        for flags, name in cases
    ]


@pytest.mark.background(15, faulty_runs)
def test_data_and_model_problems_name_the_thing_at_fault(background):
    for flags, name, proc in background:
        lines = [l for l in proc.stderr.splitlines() if l.strip() and not l.startswith("{")]
        assert proc.returncode == 2, (flags, proc.stderr[-1500:])
        assert len(lines) == 1 and name in lines[0] and "Traceback" not in proc.stderr, (flags, proc.stderr[-1500:])


@pytest.mark.parametrize(
    "prompts,message",
    [
        (["Say hi:", ""], "row 1 (counting from 0): the prompt must be a non-empty string or list of"),
        (["Say hi:", 7], "row 1 (counting from 0): the prompt must be a non-empty string or list of"),
        (["Say hi:", {"text": "hi"}], "row 1 (counting from 0): the prompt must be a non-empty string"),
        ([[{"role": "user", "content": "hi"}], "Say hi:"], "row 1 (counting from 0): the prompt must be a non-empty"),
        (["Say hi:", [{"role": "user", "content": "hi"}]], "messages, one kind in every row; not list"),
    ],
)
def test_bad_prompts_are_refused_naming_the_row(tmp_path, capsys, prompts, message):
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"prompt": p} for p in prompts]))
    assert g.main(["--dataset", str(data), "--output_dir", str(tmp_path / "o"), *SMALL]) == 2
    line = error_line(capsys)
    assert message in line and str(data) in line


def test_eval_dataset_as_a_local_file(tmp_path):
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"q": f"post {i}"}) + "\n" for i in range(5)))
    cfg = g.GRPOConfig(dataset=str(data), eval_dataset=str(data), prompt_column="q", eval_max_prompts=0)
    assert [r["prompt"] for r in g.load_eval_prompts(cfg)] == [f"post {i}" for i in range(5)]


def test_chat_prompts_use_the_chat_template(tmp_path):
    data = tmp_path / "chat.json"
    data.write_text(json.dumps([{"prompt": [{"role": "user", "content": f"hello {i}"}]} for i in range(3)]))
    seen = {}

    def spy(completions, prompts, **kw):
        seen["completions"] = completions
        return g.reward_len(completions)

    cfg = g.GRPOConfig(
        dataset=str(data),
        output_dir=str(tmp_path / "o"),
        max_steps=1,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
    )
    trainer = g.GRPOTrainer(cfg, reward_funcs=[spy])
    texts = g.prompt_texts(trainer.dataset[:1], trainer.tokenizer)
    assert texts == ["user: hello 0\nassistant:"]
    trainer.train_step()
    assert seen["completions"][0][0]["role"] == "assistant"


def test_a_malformed_jsonl_gives_one_line_naming_the_file(tmp_path, capsys):
    """datasets' own error, its type and first line, after the file's name: one line, no traceback."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"} trailing\n{"prompt": "d"}\n')
    assert g.main(["--dataset", str(data), "--output_dir", str(tmp_path / "o"), *SMALL]) == 2
    line = error_line(capsys)
    assert re.fullmatch(rf"error: --dataset {re.escape(repr(str(data)))} could not be read: \w+: \S.*", line), line
    doc = tmp_path / "prompts.json"
    doc.write_text('[\n  {"prompt": "a"},\n  {"prompt": "b"}\n  {"prompt": "c"}\n]\n')  # a missing comma, line 4
    assert g.main(["--dataset", str(doc), "--output_dir", str(tmp_path / "o"), *SMALL]) == 2
    line = error_line(capsys)
    assert re.fullmatch(rf"error: --dataset {re.escape(repr(str(doc)))} could not be read: \w+: \S.*", line), line
    assert not (tmp_path / "o").exists()  # refused before any work


def test_reading_a_local_file_leaves_datasets_logging_as_it_was(tmp_path):
    """datasets is quiet while it reads a local file, good or bad; then its settings (the user's) come back."""
    import datasets

    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a"}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"} trailing\n')
    datasets.logging.set_verbosity_info()
    datasets.enable_progress_bars()
    try:
        assert g.load_prompts(str(good)) == [{"prompt": "a"}]
        with pytest.raises(g.ConfigError):
            g.load_prompts(str(bad))
        assert datasets.logging.get_verbosity() == datasets.logging.INFO and datasets.is_progress_bar_enabled()
    finally:
        datasets.logging.set_verbosity_warning()


def test_under_bf16_autocast_the_reference_model_is_bf16(cfg_factory, monkeypatch, keep_threads):
    """The frozen reference (beta > 0) needs no float32 master weights: under bf16 autocast it is kept in bf16, half
    the memory; the policy stays float32."""
    monkeypatch.setattr(g, "cpu_has_bf16", lambda: True)  # emulated here, but the same path as a GPU's
    trainer = g.GRPOTrainer(cfg_factory(beta=0.04, bf16=True, max_steps=1, eval_steps=0))
    assert {p.dtype for p in trainer.ref_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert math.isfinite(trainer.train_step()["kl"])
    plain = g.GRPOTrainer(cfg_factory(beta=0.04, max_steps=1, output_dir=str(trainer.cfg.output_dir) + "-fp32"))
    assert {p.dtype for p in plain.ref_model.parameters()} == {torch.float32}  # float32 without autocast


def test_a_model_that_arrived_in_bf16_is_saved_in_bf16(cfg_factory, keep_threads):
    """Trained on float32 master weights, saved as it came: from_pretrained's dtype="auto" loads bf16 again, with the
    trained weights rounded to bf16 (a model that came in float32 is saved in float32)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, tok = g.load_model("tiny")
    cfg = cfg_factory(max_steps=1, eval_steps=0)
    trainer = g.GRPOTrainer(cfg, model=model.to(torch.bfloat16), processing_class=tok)
    trainer.train()
    out = g.Path(cfg.output_dir)
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    for (name, saved), trained in zip(loaded.state_dict().items(), trainer.model.state_dict().values()):
        assert torch.equal(saved, trained.to(torch.bfloat16)), name
    assert trainer.model.dtype == torch.float32  # the master weights themselves are untouched
    float_run = g.GRPOTrainer(cfg_factory(max_steps=1, eval_steps=0, output_dir=str(out) + "-fp32"))
    float_run.train()
    assert {v.dtype for v in load_file(g.Path(str(out) + "-fp32") / "model.safetensors").values()} == {torch.float32}
