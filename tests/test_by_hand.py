"""Notebook 04b runs one train_step by hand: its cells (tagged "by-hand") must give exactly train_step's update."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "04b_one_step_by_hand.ipynb"


def by_hand_cells() -> list[str]:
    nb = json.loads(NOTEBOOK.read_text())
    return ["".join(c["source"]) for c in nb["cells"]
            if c["cell_type"] == "code" and "by-hand" in c["metadata"].get("tags", [])]


def run_by_hand(tmp_path, replace: tuple[str, str] | None = None) -> dict:
    """Execute the notebook's by-hand cells (optionally with one piece of code replaced); return the namespace."""
    import grpo_ssr

    namespace = {"grpo_ssr": grpo_ssr, "torch": torch, "TMP": tmp_path, "print": lambda *a, **k: None}
    threads = torch.get_num_threads()
    try:
        for source in by_hand_cells():
            if replace is not None:
                source = source.replace(*replace)
            exec(compile(source, str(NOTEBOOK), "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
    return namespace


def weight_difference(ns: dict) -> float:
    torch.set_rng_state(ns["rng_before"][0])
    ns["twin"].train_step()
    return max((p - q).abs().max().item()
               for p, q in zip(ns["trainer"].model.parameters(), ns["twin"].model.parameters()))


def test_notebook_has_the_walk():
    calls = "\n".join(by_hand_cells())
    for name in ("generate_batch", "buffer.add", "buffer.sample", "repad", "combine_tensor_dict", "per_token_logps",
                 "grpo_loss", "backward", "clip_grad_norm_", "optimizer.step", "scheduler.step"):
        assert name in calls, f"the by-hand cells of {NOTEBOOK.name} do not call {name}"
    assert "train_step" not in calls, "the by-hand walk must not call train_step itself"


@pytest.mark.slow
def test_hand_run_step_equals_train_step(tmp_path):
    ns = run_by_hand(tmp_path)
    assert ns["moved"] > 0  # the step did change the weights
    assert weight_difference(ns) <= 1e-7


@pytest.mark.slow
def test_the_comparison_notices_a_missing_stage(tmp_path):
    """Normalise each micro-batch by its own tokens instead of the step's (bnpo's rule, not dapo's): the weights then
    differ, so the comparison can fail."""
    dapo = "num_items_in_batch=step_tokens"
    assert dapo in "\n".join(by_hand_cells())
    ns = run_by_hand(tmp_path, replace=(dapo, "num_items_in_batch=own_tokens[i]"))
    assert weight_difference(ns) > 1e-6
