"""The real training path: main(), GRPOTrainer steps, generation, loading from local files, SSR in the loop."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import grpo_ssr as g
from conftest import ROOT


def _metrics(path):
    """The training lines of a run (evaluation lines, which carry eval_reward, are left out)."""
    return [r for r in map(json.loads, open(path / "metrics.jsonl")) if "eval_reward" not in r]


def test_help_lists_every_flag():
    out = subprocess.run([sys.executable, str(ROOT / "grpo_ssr.py"), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0
    for f in g.dataclasses.fields(g.GRPOConfig):
        assert f"--{f.name}" in out.stdout, f.name
    assert "Completions per micro-batch" in out.stdout


def test_main_trains_and_writes_everything(tmp_path):
    out = tmp_path / "run"
    torch.manual_seed(0)
    before, _ = g.load_model("tiny")  # main seeds 0 too, so this is the same initial model
    rc = g.main(["--output_dir", str(out), "--max_steps", "3", "--per_device_train_batch_size", "8",
                 "--num_generations", "4", "--max_completion_length", "16", "--device", "cpu"])
    assert rc == 0
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward", "reward_std", "frac_reward_zero_std", "loss", "completion_length", "clip_ratio",
                "buffer_size", "step_time", "replay_frac", "sample_age", "adv_abs_trained", "adv_abs_fresh",
                "zero_adv_rejected", "buffer_ess", "frac_zero_adv_trained", "unique_sample_frac", "sample_age_max"):
        assert key in rows[0], key
    assert "kl" not in rows[0]  # beta = 0
    saved = json.loads((out / "grpo_config.json").read_text())
    assert saved["max_steps"] == 3 and saved["replay_buffer_class"] == "SSRReplayBuffer"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    after = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).pad_token == "<|pad|>"
    changed = [not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values())]
    assert all(changed), "every parameter tensor should move after three AdamW steps"


def test_refuses_to_overwrite_a_run(tmp_path, capsys):
    args = ["--output_dir", str(tmp_path / "r"), "--max_steps", "1", "--per_device_train_batch_size", "8",
            "--num_generations", "4", "--max_completion_length", "8"]
    assert g.main(args) == 0
    assert g.main(args) == 2
    assert "--output_dir" in capsys.readouterr().err
    assert g.main(args + ["--overwrite_output_dir"]) == 0


def test_beta_logs_kl_and_uses_a_frozen_reference(cfg_factory):
    trainer = g.GRPOTrainer(cfg_factory(beta=0.1, max_steps=2))
    m1, m2 = trainer.train_step(), trainer.train_step()
    assert m1["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy equals the reference before any update
    assert m2["kl"] > 0
    assert all(not p.requires_grad for p in trainer.ref_model.parameters())


def _chi2_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.09 is p = 0.001."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def test_sampling_is_the_distribution_the_logps_describe(tiny):
    """First-token counts follow softmax(logits / 0.7) (chi-square, fixed seed): no hidden top-k or top-p."""
    model, tok = tiny
    torch.manual_seed(0)
    n, temperature = 20_000, 0.7
    out = g.generate_completions(model, tok, ["TL;DR:"], n, 64, 1, temperature=temperature)
    counts = np.bincount(out["completion_ids"][:, 0].numpy(), minlength=len(tok))
    ids = tok("TL;DR:", add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1].double()

    def chi2(probs):
        expected = probs.numpy() * n
        return float(((counts - expected) ** 2 / expected).sum())

    critical = _chi2_critical(len(tok) - 1)
    assert chi2(torch.softmax(logits / temperature, -1)) < critical
    assert chi2(torch.softmax(logits, -1)) > critical  # power: temperature 1 is told apart
    assert (counts > 0).sum() > 100  # a top-k of 50 would cap this at 50
    # per_token_logps describes the same distribution
    full = torch.cat([ids, torch.tensor([[int(np.argmax(counts))]])], 1)
    lp = g.per_token_logps(model, full, torch.ones_like(full), 1, temperature=temperature)
    assert lp.exp().item() == pytest.approx(torch.softmax(logits / temperature, -1).max().item(), rel=1e-4)


def test_hub_generation_defaults_do_not_leak_into_sampling(tmp_path):
    """A model saved with greedy-ish defaults (top_k=1) still samples from the full distribution after load_model."""
    torch.manual_seed(0)
    tok = g.build_tiny_tokenizer()
    model = g.build_tiny_model(len(tok))
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(do_sample=True, top_k=1, repetition_penalty=5.0)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    loaded, ltok = g.load_model(str(tmp_path / "m"))
    out = g.generate_completions(loaded, ltok, ["abc"], 64, 16, 1)
    assert out["completion_ids"][:, 0].unique().numel() > 20


def test_real_loading_path_local_model_and_jsonl(tmp_path):
    """--model DIR (save_pretrained) and --dataset FILE.jsonl with another prompt column and chat prompts."""
    torch.manual_seed(0)
    tok = g.build_tiny_tokenizer()
    g.build_tiny_model(len(tok)).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rows = [{"question": f"Summarise post {i}: the cat sat.", "label": i} for i in range(4)]
    rows += [{"question": [{"role": "user", "content": f"Say hi {i}"}], "label": 9} for i in range(0)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = {}

    def reward_with_column(completions, prompts, label, **kw):
        seen["label"], seen["prompts"] = label, prompts
        return [float(l) for l in label]

    cfg = g.GRPOConfig(model=str(tmp_path / "model"), dataset=str(data), prompt_column="question",
                       output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8,
                       num_generations=4, max_completion_length=8)
    history = g.run(cfg, reward_funcs=[reward_with_column])
    assert len(history) == 2
    assert len(seen["label"]) == 8 and seen["prompts"][0].startswith("Summarise post")
    assert seen["label"][:4] == [seen["label"][0]] * 4  # dataset columns are repeated per completion


def test_chat_prompts_use_the_chat_template(tmp_path):
    data = tmp_path / "chat.json"
    data.write_text(json.dumps([{"prompt": [{"role": "user", "content": f"hello {i}"}]} for i in range(3)]))
    seen = {}

    def spy(completions, prompts, **kw):
        seen["completions"] = completions
        return g.reward_len(completions)

    cfg = g.GRPOConfig(dataset=str(data), output_dir=str(tmp_path / "o"), max_steps=1, per_device_train_batch_size=8,
                       num_generations=4, max_completion_length=8)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[spy])
    texts = g.prompt_texts(trainer.dataset[:1], trainer.tokenizer)
    assert texts == ["user: hello 0\nassistant:"]
    trainer.train_step()
    assert seen["completions"][0][0]["role"] == "assistant"


def test_weighted_reward_functions(cfg_factory):
    calls = []

    def const(v):
        def f(completions, **kw):
            calls.append(v)
            return [v] * len(completions)
        f.__name__ = f"const_{v}"
        return f

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[const(1.0), const(3.0)], reward_weights=[2.0, 0.5])
    samples = trainer.generate_batch()
    assert trainer.last_gen_metrics["reward"] == pytest.approx(2.0 * 1.0 + 0.5 * 3.0)
    assert trainer.last_gen_metrics["rewards/const_3.0"] == 3.0
    assert all(float(s["advantages"]) == 0.0 for s in samples)


def test_old_logps_forward_is_skipped_only_where_every_sample_trains_in_its_own_step(cfg_factory):
    for flags, skipped in ((dict(replay_buffer_class="ReplayBuffer"), True),
                           (dict(replay_buffer_class="ReplayBuffer", num_iterations=2), True),
                           (dict(), True),  # SSR fill, num_iterations 1
                           (dict(num_iterations=2), False),  # fill: a zero slot may keep its own sample later
                           (dict(ssr_mode="replace"), False)):
        trainer = g.GRPOTrainer(cfg_factory(**flags))
        assert trainer.old_from_training is skipped, flags
        assert all((s["old_per_token_logps"] is None) is skipped for s in trainer.generate_batch()), flags


@pytest.mark.slow
def test_default_run_learns(tmp_path):
    """`python grpo_ssr.py` with no flags but the output folder: the reward climbs by at least 10."""
    out = tmp_path / "default"
    proc = subprocess.run([sys.executable, str(ROOT / "grpo_ssr.py"), "--output_dir", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rewards = [r["reward"] for r in _metrics(out)]
    assert len(rewards) == g.GRPOConfig().max_steps
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert last - first >= 10, (first, last)
