"""Part I runs alone: GRPOStep trains from Part I's names, and Part I uses nothing that Part II defines."""

import ast

import pytest
import torch

import grpo_ssr as g
from conftest import ROOT


def parts(source: str) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """The file's top-level statements before the Part II banner, and those after it."""
    split = next(i for i, line in enumerate(source.splitlines(), 1) if line.startswith("# Part II"))
    body = ast.parse(source).body
    return [n for n in body if n.lineno < split], [n for n in body if n.lineno > split]


def defined(nodes: list[ast.stmt]) -> set[str]:
    names = set()
    for n in nodes:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            names |= {t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return names


def part_one_problems(source: str) -> list[str]:
    """What breaks the rule: a name Part I uses that Part II defines, and an attribute GRPOStep's methods read that
    no line of Part I sets (or defines as a method)."""
    one, two = parts(source)
    used = {n.id for node in one for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    problems = [f"Part I uses {name}, which Part II defines" for name in sorted(used & (defined(two) - defined(one)))]
    step = next(n for n in one if isinstance(n, ast.ClassDef) and n.name == "GRPOStep")
    attrs = [
        n
        for n in ast.walk(step)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    ]
    have = {a.attr for a in attrs if isinstance(a.ctx, ast.Store)} | {
        f.name for f in step.body if isinstance(f, ast.FunctionDef)
    }
    have |= {t.id for n in step.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    problems += [
        f"GRPOStep reads self.{name}, which Part I never sets"
        for name in sorted({a.attr for a in attrs if isinstance(a.ctx, ast.Load)} - have)
    ]
    return problems


def test_part_one_uses_nothing_that_part_two_defines():
    assert part_one_problems((ROOT / "grpo_ssr.py").read_text()) == []


def test_the_rule_catches_a_part_one_that_leans_on_part_two():
    source = (ROOT / "grpo_ssr.py").read_text()
    leaning = source.replace("self.eos_ids = eos_token_ids(model, tokenizer)", "self.eos_ids = lean_head(model)")
    assert leaning != source and part_one_problems(leaning) == ["Part I uses lean_head, which Part II defines"]
    borrowing = source.replace("self.generation_metrics = mean_metrics(batches)", "self.generation_metrics = self.cfgs")
    assert borrowing != source and part_one_problems(borrowing) == ["GRPOStep reads self.cfgs, which Part I never sets"]


@pytest.mark.slow
def test_grpo_step_alone_learns_the_length_reward():
    """GRPOStep from Part I's names only (the tiny model and its tokenizer come from Part II's builders): 40 plain
    GRPO steps raise the length reward (it measures -|20 - characters|) by more than 3 characters."""
    torch.manual_seed(0)
    tokenizer = g.build_tiny_tokenizer()
    model = g.build_tiny_model(len(tokenizer))
    cfg = g.AlgorithmConfig(max_steps=40, max_completion_length=48)
    step = g.GRPOStep(model, tokenizer, [g.reward_len], cfg, [{"prompt": p["prompt"]} for p in g.builtin_prompts()])
    rewards = [step.train_step()["reward"] for _ in range(cfg.max_steps)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 3, (first, last)  # a sign error, or no update at all, fails this
    assert (
        step.step == 40
        and step.sample_uid == 40 * cfg.generation_batch_size
        and isinstance(step.buffer, g.ReplayBuffer)
    )
