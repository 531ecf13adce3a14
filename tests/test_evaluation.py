"""Held-out evaluation (Part II): evaluate() on the tiny model, which data set is held out, --eval_steps lines through
the real training loop, the binary reward's accuracy."""

import pytest
import torch

import grpo_ssr as g
from conftest import metrics_lines


def test_evaluate_on_the_tiny_model(tiny):
    model, tok = tiny
    rows = g.builtin_prompts(heldout=True)[:3]
    seen = {}

    def spy(completions, prompts, **kw):
        seen.setdefault("calls", []).append(list(completions))
        return g.reward_len(completions)

    state = torch.get_rng_state()
    cfg = g.GRPOConfig(eval_num_generations=5, max_completion_length=12, seed=3)
    m = g.evaluate(model, tok, rows, [spy], cfg)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random stream is untouched
    greedy, sampled = seen["calls"]
    assert len(greedy) == 3 and len(sampled) == 15
    # greedy is argmax decoding: it matches transformers' greedy generate on each prompt
    for row, text in zip(rows, greedy):
        ids = tok(row["prompt"], return_tensors="pt", add_special_tokens=False).input_ids
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        assert tok.decode(ref[0, ids.size(1) :], skip_special_tokens=True) == text
    assert m["eval_greedy_reward"] == pytest.approx(sum(g.reward_len(greedy)) / 3)
    assert m["eval_reward"] == pytest.approx(sum(g.reward_len(sampled)) / 15)
    assert "eval_accuracy" not in m and m["eval_prompts"] == 3  # reward_len is not binary
    again = g.evaluate(model, tok, rows, [g.reward_len], cfg)
    assert again["eval_reward"] == m["eval_reward"]  # same seed, same draws

    half = lambda completions, **kw: [float(i % 2) for i in range(len(completions))]
    b = g.evaluate(model, tok, rows, [half], g.GRPOConfig(eval_num_generations=4, max_completion_length=4))
    assert b["eval_accuracy"] == 0.5 and b["eval_greedy_accuracy"] == pytest.approx(1 / 3)  # binary: accuracy too


def test_evaluate_draws_what_generate_calls_draw_chunk_by_chunk(tiny):
    """evaluate scores each chunk of prompts greedily, then by sampling: exactly what two
    generate_completions calls a chunk give, under the evaluation's seed."""
    model, tok = tiny
    rows = g.builtin_prompts(heldout=True)[:5]
    seen = []

    def spy(completions, prompts, **kw):
        seen.append(list(completions))
        return [0.0] * len(completions)

    g.evaluate(model, tok, rows, [spy], g.GRPOConfig(eval_num_generations=3, max_completion_length=10, seed=7), chunk=3)
    assert [len(c) for c in seen] == [3, 9, 2, 6]  # chunks of 3 and 2 prompts: greedy, then 3 sampled a prompt

    def texts(batch):
        mask = batch["completion_mask"]
        return tok.batch_decode(
            batch["completion_ids"] * mask + tok.pad_token_id * (1 - mask), skip_special_tokens=True
        )

    expected = {"greedy": [], "sampled": []}
    with torch.random.fork_rng():
        torch.manual_seed(7)
        for s in range(0, 5, 3):
            prompts = g.prompt_texts(rows[s : s + 3], tok)
            expected["greedy"] += texts(g.generate_completions(model, tok, prompts, 1, 512, 10, greedy=True))
            expected["sampled"] += texts(g.generate_completions(model, tok, prompts, 3, 512, 10, temperature=1.0))
    assert seen[0] + seen[2] == expected["greedy"] and seen[1] + seen[3] == expected["sampled"]
    assert len(set(expected["sampled"])) > 3  # the sampled ones are sampled


def test_a_data_set_passed_in_is_not_evaluated_on_the_builtin_split(cfg_factory, capsys):
    """A data set passed from Python is not the one --dataset names, so its held-out split must not be used; an
    eval_dataset passed alongside is."""
    rows = [{"prompt": f"Say {i}:", "label": float(i)} for i in range(4)]

    def by_label(completions, label, **kw):  # needs the passed data set's own column
        return label

    cfg = cfg_factory(max_steps=1, eval_steps=1)
    g.GRPOTrainer(cfg, reward_funcs=[by_label], train_dataset=rows).train()
    assert "no evaluation" in capsys.readouterr().err
    assert g.read_metrics(g.Path(cfg.output_dir) / "metrics.jsonl")[1] == []
    cfg = cfg_factory(max_steps=1, eval_steps=1, output_dir=cfg.output_dir + "-2")
    g.GRPOTrainer(cfg, reward_funcs=[by_label], train_dataset=rows, eval_dataset=rows[:2]).train()
    evals = g.read_metrics(g.Path(cfg.output_dir) / "metrics.jsonl")[1]
    assert [e["step"] for e in evals] == [0, 1] and all(e["eval_prompts"] == 2 for e in evals)
    cfg = cfg_factory(max_steps=2, eval_steps=0, output_dir=cfg.output_dir + "-3")  # 0: never, an eval_dataset too
    assert g.GRPOTrainer(cfg, reward_funcs=[by_label], train_dataset=rows, eval_dataset=rows[:2]).eval_rows is None


def test_test_is_the_held_out_split_of_a_task_made_in_code(tmp_path):
    """--eval_dataset names a split of --dataset: for the tasks made in code, test is their held-out split."""
    cfg = lambda split: g.GRPOConfig(output_dir=str(tmp_path), eval_dataset=split, eval_max_prompts=0)
    heldout, train = g.task_prompts("builtin", heldout=True), g.task_prompts("builtin")
    assert g.load_eval_prompts(cfg("test")) == heldout and g.load_eval_prompts(cfg("train")) == train != heldout


@pytest.mark.pictures
def test_eval_steps_writes_eval_lines_without_changing_training(cfg_factory, tmp_path):
    cfg = cfg_factory(max_steps=5, eval_steps=2, eval_num_generations=2)
    history = g.run(cfg)
    out = g.Path(cfg.output_dir)
    train, evals = metrics_lines(out)
    assert [r["step"] for r in evals] == [0, 2, 4, 5]  # before training, every 2 steps and at the last step
    for r in evals:
        assert {"eval_reward", "eval_greedy_reward", "eval_completion_length"} <= set(r)
        assert all(k == "step" or k.startswith("eval_") for k in r)
        assert not any(k.startswith("eval_") for t in train for k in t)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5] and len(history) == 5
    # evaluation draws from its own random stream: the training lines are those of a run without it
    g.run(cfg_factory(max_steps=5, eval_steps=0, output_dir=str(tmp_path / "off")))
    off, none = metrics_lines(tmp_path / "off")
    assert none == []
    strip = lambda rows: [{k: v for k, v in r.items() if k != "step_time"} for r in rows]
    assert strip(train) == strip(off)
    png = out / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_binary_reward_logs_accuracy(cfg_factory):
    cfg = cfg_factory(max_steps=1, eval_steps=1, eval_num_generations=2, reward_funcs="reward_len_binary")
    g.run(cfg)
    _, evals = metrics_lines(g.Path(cfg.output_dir))
    assert [r["step"] for r in evals] == [0, 1]
    assert all(0 <= r["eval_accuracy"] <= 1 and r["eval_accuracy"] == r["eval_reward"] for r in evals)
    assert all("eval_greedy_accuracy" in r for r in evals)
