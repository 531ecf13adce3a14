import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach the Hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import grpo_ssr  # noqa: E402


def small_config(tmp_path, **overrides) -> grpo_ssr.GRPOConfig:
    """A few fast steps of the tiny model: 8 completions a micro-batch, groups of 4, 16 new tokens."""
    base = dict(output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=8, num_generations=4,
                max_completion_length=16, device="cpu", seed=0)
    base.update(overrides)
    return grpo_ssr.GRPOConfig(**base)


@pytest.fixture
def cfg_factory(tmp_path):
    return lambda **kw: small_config(tmp_path, **kw)


@pytest.fixture(scope="session")
def tiny():
    """One tiny model and tokenizer, seeded, shared by the tests that only read them."""
    import torch

    torch.manual_seed(0)
    model, tok = grpo_ssr.load_model("tiny")
    return model.eval(), tok
