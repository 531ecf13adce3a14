"""One optimizer step through the real loop: four configurations pinned to what they computed before the file was
restructured (2026-12-01), so that a refactor proves it changed nothing."""
import pytest
import torch

import grpo_ssr as g

CONFIGS = {"default": {}, "replace": {"ssr_mode": "replace"},
           "uniform": {"replay_buffer_class": "ReplayBuffer", "num_iterations": 2, "gradient_accumulation_steps": 2},
           "beta": {"beta": 0.04}}
# Steps 2 and 4 of 4 (max_steps 4, the default settings otherwise, one torch thread), as the file computed them
# before it was split into Part I and Part II. The tolerance allows another CPU's rounding, not another algorithm.
PINNED = {
    'default': [
        {'step': 2, 'reward': -36.8125, 'loss': 0.26086071133613586, 'grad_norm': 0.22699512541294098, 'clip_ratio': 0.0},
        {'step': 4, 'reward': -31.5, 'loss': 0.42624497413635254, 'grad_norm': 0.31557130813598633, 'clip_ratio': 0.0},
    ],
    'replace': [
        {'step': 2, 'reward': -36.875, 'loss': 0.2549920380115509, 'grad_norm': 0.6532236337661743, 'clip_ratio': 0.008998875506222248},
        {'step': 4, 'reward': -29.5, 'loss': 0.05086508020758629, 'grad_norm': 0.8097429871559143, 'clip_ratio': 0.03999999910593033},
    ],
    'uniform': [
        {'step': 2, 'reward': -32.5, 'loss': 0.20628806203603745, 'grad_norm': 0.2737736403942108, 'clip_ratio': 0.0381755605340004},
        {'step': 4, 'reward': -34.3125, 'loss': 0.16192282736301422, 'grad_norm': 0.25281813740730286, 'clip_ratio': 0.0},
    ],
    'beta': [
        {'step': 2, 'reward': -36.8125, 'loss': 0.26100727915763855, 'grad_norm': 0.2271357625722885, 'clip_ratio': 0.0, 'kl': 0.003663630923256278},
        {'step': 4, 'reward': -31.5625, 'loss': 0.4269564747810364, 'grad_norm': 0.31309646368026733, 'clip_ratio': 0.0, 'kl': 0.008115451782941818},
    ],
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_runs_match_the_pinned_lines(tmp_path, name):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = g.GRPOConfig(output_dir=str(tmp_path / name), max_steps=4, eval_steps=0, device="cpu", **CONFIGS[name])
        rows = g.GRPOTrainer(cfg).train()
    finally:
        torch.set_num_threads(threads)
    for pinned in PINNED[name]:
        row = rows[pinned["step"] - 1]
        for key, value in pinned.items():
            assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (name, pinned["step"], key)
