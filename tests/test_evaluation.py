"""Held-out evaluation: the splits never overlap, the arithmetic reward on hand-written completions, evaluate() on the
tiny model, --eval_steps lines through the real training loop, --eval_only's table, metrics.png, bf16 on CPU."""
import json

import pytest
import torch

import grpo_ssr as g


def _lines(out):
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    return [r for r in rows if "eval_reward" not in r], [r for r in rows if "eval_reward" in r]


def _question(row) -> tuple[int, int]:
    a, _, b = row["prompt"][-1]["content"].rstrip(" =").partition(" + ")
    return int(a), int(b)


# ----------------------------------------------------------------------------------------------------------------------
# Data sets and their held-out splits
# ----------------------------------------------------------------------------------------------------------------------

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
    assert [r["level"] for r in held[:len(levels)]] == levels  # round-robin: the first prompts cover every level


def test_arithmetic_through_load_prompts_and_the_held_out_loader():
    cfg = g.GRPOConfig(dataset="arithmetic", eval_max_prompts=10, seed=7)
    train = g.load_prompts("arithmetic")
    held = g.load_eval_prompts(cfg)
    assert len(held) == 10 and held == g.arithmetic_prompts([1, 2], heldout=True)[:10]  # the same for every seed
    assert {r["level"] for r in train} == {1, 2} and len(train) == 140
    assert g.arithmetic_levels("arithmetic:4") is None and g.arithmetic_levels("arithmetic:x") is None


def test_builtin_held_out_posts_are_not_in_training():
    train, held = g.builtin_prompts(), g.builtin_prompts(heldout=True)
    assert len(train) == 36 and len(held) == 12
    for post in g.BUILTIN_HELDOUT_POSTS:
        assert not any(post in r["prompt"] for r in train)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert g.load_eval_prompts(g.GRPOConfig()) == held
    assert g.load_eval_prompts(g.GRPOConfig(dataset="some/hub-id")) is None  # no split to hold out


def test_eval_dataset_as_a_local_file(tmp_path):
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"q": f"post {i}"}) + "\n" for i in range(5)))
    cfg = g.GRPOConfig(dataset=str(data), eval_dataset=str(data), prompt_column="q", eval_max_prompts=0)
    assert [r["prompt"] for r in g.load_eval_prompts(cfg)] == [f"post {i}" for i in range(5)]


# ----------------------------------------------------------------------------------------------------------------------
# The binary reward
# ----------------------------------------------------------------------------------------------------------------------

REWARD_CASES = [  # (completion, answer, reward)
    ("12", 12, 1.0),
    (" 12.", 12, 1.0),  # a full stop ends the number
    ("The answer is 12.", 12, 1.0),
    ("12\nBecause 7 + 5 = 12", 12, 1.0),  # only the first number counts
    ("7 + 5 = 12", 12, 0.0),  # restating the question is not answering it
    ("10 11 12 13 14 15", 12, 0.0),  # listing numbers until one is right is not rewarded
    ("11, 12 or 13", 12, 0.0),
    ("120", 12, 0.0),
    ("12.5", 12, 0.0),
    ("12.0", 12, 1.0),
    ("-3", -3, 1.0),
    ("twelve", 12, 0.0),
    ("", 12, 0.0),
    ("The answer is 5", "5", 1.0),  # an answer column of strings works too
]


def test_reward_accuracy_on_hand_written_completions():
    completions = [c for c, _, _ in REWARD_CASES]
    answers = [a for _, a, _ in REWARD_CASES]
    assert g.reward_accuracy(completions, answer=answers) == [r for _, _, r in REWARD_CASES]
    chat = [[{"role": "assistant", "content": c}] for c in completions]  # what a chat prompt's completions look like
    assert g.reward_accuracy(chat, answer=answers, prompts=None) == [r for _, _, r in REWARD_CASES]
    assert g.REWARD_FUNCS["reward_accuracy"] is g.reward_accuracy


# ----------------------------------------------------------------------------------------------------------------------
# evaluate() on the tiny model
# ----------------------------------------------------------------------------------------------------------------------

def test_evaluate_on_the_tiny_model(tiny):
    model, tok = tiny
    rows = g.builtin_prompts(heldout=True)[:3]
    seen = {}

    def spy(completions, prompts, **kw):
        seen.setdefault("calls", []).append(list(completions))
        return g.reward_len(completions)

    state = torch.get_rng_state()
    m = g.evaluate(model, tok, rows, [spy], num_generations=5, max_completion_length=12, seed=3)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random stream is untouched
    greedy, sampled = seen["calls"]
    assert len(greedy) == 3 and len(sampled) == 15
    # greedy is argmax decoding: it matches transformers' greedy generate on each prompt
    for row, text in zip(rows, greedy):
        ids = tok(row["prompt"], return_tensors="pt", add_special_tokens=False).input_ids
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        assert tok.decode(ref[0, ids.size(1):], skip_special_tokens=True) == text
    assert m["eval_greedy_reward"] == pytest.approx(sum(g.reward_len(greedy)) / 3)
    assert m["eval_reward"] == pytest.approx(sum(g.reward_len(sampled)) / 15)
    assert "eval_accuracy" not in m and m["eval_prompts"] == 3  # reward_len is not binary
    again = g.evaluate(model, tok, rows, [g.reward_len], num_generations=5, max_completion_length=12, seed=3)
    assert again["eval_reward"] == m["eval_reward"]  # same seed, same draws

    half = lambda completions, **kw: [float(i % 2) for i in range(len(completions))]
    b = g.evaluate(model, tok, rows, [half], num_generations=4, max_completion_length=4)
    assert b["eval_accuracy"] == 0.5 and b["eval_greedy_accuracy"] == pytest.approx(1 / 3)  # binary: accuracy too


# ----------------------------------------------------------------------------------------------------------------------
# Through the real training loop and the CLI
# ----------------------------------------------------------------------------------------------------------------------

def test_eval_steps_writes_eval_lines_without_changing_training(cfg_factory, tmp_path):
    cfg = cfg_factory(max_steps=5, eval_steps=2, eval_num_generations=2)
    history = g.run(cfg)
    out = g.Path(cfg.output_dir)
    train, evals = _lines(out)
    assert [r["step"] for r in evals] == [0, 2, 4, 5]  # before training, every 2 steps and at the last step
    for r in evals:
        assert {"eval_reward", "eval_greedy_reward", "eval_completion_length"} <= set(r)
        assert all(k == "step" or k.startswith("eval_") for k in r)
        assert not any(k.startswith("eval_") for t in train for k in t)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5] and len(history) == 5
    # evaluation draws from its own random stream: the training lines are those of a run without it
    g.run(cfg_factory(max_steps=5, eval_steps=0, output_dir=str(tmp_path / "off")))
    off, none = _lines(tmp_path / "off")
    assert none == []
    strip = lambda rows: [{k: v for k, v in r.items() if k != "step_time"} for r in rows]
    assert strip(train) == strip(off)
    png = out / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_binary_reward_logs_accuracy(cfg_factory):
    cfg = cfg_factory(max_steps=1, eval_steps=1, eval_num_generations=2, reward_funcs="reward_len_binary")
    g.run(cfg)
    _, evals = _lines(g.Path(cfg.output_dir))
    assert [r["step"] for r in evals] == [0, 1]
    assert all(0 <= r["eval_accuracy"] <= 1 and r["eval_accuracy"] == r["eval_reward"] for r in evals)
    assert all("eval_greedy_accuracy" in r for r in evals)


def test_eval_only_prints_the_before_after_table(cfg_factory, capsys):
    cfg = cfg_factory(max_steps=2, eval_steps=2, eval_num_generations=2)
    g.run(cfg)
    _, evals = _lines(g.Path(cfg.output_dir))
    capsys.readouterr()
    assert g.main(["--eval_only", "--output_dir", cfg.output_dir, "--eval_num_generations", "2",
                   "--max_completion_length", "16", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].split()[0] == "tiny" and lines[-1].split()[0] == cfg.output_dir
    # the same numbers as the run's own evaluations before and after training
    before, after = (float(l.split()[1]) for l in lines[-2:])
    assert lines[-3].split()[1] == "reward"
    assert before == pytest.approx(evals[0]["eval_reward"], abs=1e-3)
    assert after == pytest.approx(evals[-1]["eval_reward"], abs=1e-3)
    assert sorted(p.name for p in g.Path(cfg.output_dir).glob("metrics*")) == ["metrics.jsonl", "metrics.png"]


def test_plot_is_skipped_with_a_note_without_matplotlib(cfg_factory, monkeypatch, capsys):
    cfg = cfg_factory(max_steps=1, eval_steps=0)
    for name in [m for m in g.sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(g.sys.modules, name, None)  # importing any of matplotlib now raises ImportError,
        # also when an earlier test had imported it (its submodules would otherwise still be found)
    g.run(cfg)
    assert not (g.Path(cfg.output_dir) / "metrics.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# bf16 autocast on a CPU
# ----------------------------------------------------------------------------------------------------------------------

def test_head_logprobs_backward_replays_cpu_autocast():
    """Under CPU bf16 autocast, backward must rebuild the bf16 logits the forward normalised: then d logp / d bias
    = onehot - p sums to 0 over the vocabulary. Rebuilding them in float32 leaves a visible error."""
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 300)
    head.weight.data *= 8  # logits of a few tens, where bf16 rounding shows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = g.chunked_head_logps(torch.randn(1, 1, 64), head, torch.tensor([[5]]), 1.0, 16)
    lp.sum().backward()
    assert abs(float(head.bias.grad.sum())) < 1e-5


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
    with pytest.warns(UserWarning, match=r"--bf16: this CPU has no bf16 instructions \(AVX512-BF16 or AMX\)"):
        device, autocast = g.pick_device("cpu", bf16=True)
    with autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert device.type == "cpu"


def test_cpu_has_bf16_reads_torchs_own_probes(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert g.cpu_has_bf16() is False
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert g.cpu_has_bf16() is True


def test_a_data_set_passed_in_is_not_evaluated_on_the_builtin_split(cfg_factory, capsys):
    """A data set passed from Python is not the one --dataset names, so its held-out split must not be used; an
    eval_dataset passed alongside is."""
    rows = [{"prompt": f"Say {i}:", "label": float(i)} for i in range(4)]

    def by_label(completions, label, **kw):  # needs the passed data set's own column
        return label

    cfg = cfg_factory(max_steps=1, eval_steps=1)
    g.GRPOTrainer(cfg, reward_funcs=[by_label], dataset=rows).train()
    assert "no evaluation" in capsys.readouterr().err
    assert g.read_metrics(g.Path(cfg.output_dir) / "metrics.jsonl")[1] == []
    cfg = cfg_factory(max_steps=1, eval_steps=1, output_dir=cfg.output_dir + "-2")
    g.GRPOTrainer(cfg, reward_funcs=[by_label], dataset=rows, eval_dataset=rows[:2]).train()
    evals = g.read_metrics(g.Path(cfg.output_dir) / "metrics.jsonl")[1]
    assert [e["step"] for e in evals] == [0, 1] and all(e["eval_prompts"] == 2 for e in evals)
