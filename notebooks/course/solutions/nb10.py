"""Notebook 10 · build GRPO yourself: solutions. Each piece is written from scratch; the checks compare it with
grpo_ssr's (group_advantages, grpo_loss, SSRReplayBuffer, GRPOStep's core) on fixed inputs."""

import math

import torch

import grpo_ssr


# 10.1: A_i = (r_i - group mean) / (group std + 1e-4), the std unbiased (ddof 1, as TRL). A NaN reward (no reward
# function scored it) is left out of its group's mean and std and gets 0; a group whose scored rewards are all equal
# (or that has fewer than two) gets exactly 0, not a rounding error divided by 1e-4.
def my_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    grouped = rewards.view(-1, num_generations)  # (B/G, G)
    scored = ~grouped.isnan()
    count = scored.sum(dim=1, keepdim=True)  # (B/G, 1)
    mean = grouped.nansum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(scored, grouped - mean, 0.0)
    std = (centred.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    spread = grouped.nan_to_num(nan=-math.inf).amax(dim=1) > grouped.nan_to_num(nan=math.inf).amin(dim=1)  # (B/G,)
    adv = torch.where(spread[:, None] & scored, centred / (std + 1e-4), 0.0)
    return adv.view(-1)


# 10.2: the clipped surrogate, -min(rho * A, clip(rho, 1 - eps, 1 + eps) * A), on the completion's tokens only, and one
# micro-batch's share of the step's loss. dapo: the summed token losses / the tokens of the whole step. grpo: each
# sequence's mean over its own tokens, summed, / the sequences of the whole step. Either way the micro-batches' losses
# add up to the loss of the step's batch taken whole.
def my_loss(logps, old_logps, advantages, completion_mask, loss_type, step_tokens, step_sequences, epsilon=0.2):
    mask = completion_mask.to(logps.dtype)  # (B, C)
    log_ratio = torch.where(completion_mask.bool(), logps - old_logps, 0.0)  # padded slots: ratio exactly 1
    ratio = log_ratio.exp()
    adv = advantages[:, None]  # (B, 1)
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - epsilon, 1 + epsilon) * adv) * mask  # (B, C)
    if loss_type == "dapo":
        return per_token.sum() / step_tokens
    if loss_type == "grpo":
        return (per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / step_sequences
    raise ValueError(f"loss_type {loss_type!r}: dapo or grpo")


# 10.3: SSR's draw: P(i) ~ |A_i|^alpha * exp(-age_i / age_decay) (age_decay 0: no decay), and 0 for an empty slot,
# whatever it still holds. A zero advantage gets 0 even at alpha = 0 (where |0| ** 0 would be 1).
def my_ssr_probabilities(advantages, ages, filled, alpha, age_decay):
    size = advantages.double().abs()
    weights = torch.where(size > 0, size**alpha, 0.0)
    if age_decay > 0:
        weights = weights * torch.exp(-ages.double() / age_decay)
    weights = torch.where(filled, weights, 0.0)  # (capacity,)
    return weights / weights.sum()


# 10.4: the core of a step. The old log-probs are the sampling policy's: one forward before any update, without a
# graph; then num_iterations optimizer steps, each over every micro-batch (the gradients add up), clipped to
# max_grad_norm, then cleared.
def my_logps(model, micro_batch: dict, temperature: float) -> torch.Tensor:
    ids = torch.cat([micro_batch["prompt_ids"], micro_batch["completion_ids"]], dim=1)  # (B, T)
    mask = torch.cat([micro_batch["prompt_mask"], micro_batch["completion_mask"]], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # left padding: count only the real tokens before
    C = micro_batch["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -C - 1 : -1]  # (B, C, V)
    return grpo_ssr.selective_log_softmax(logits / temperature, micro_batch["completion_ids"])  # (B, C)


def my_train_step(model, optimizer, micro_batches: list[dict], cfg) -> list[float]:
    with torch.no_grad():
        old = [my_logps(model, mb, cfg.temperature) for mb in micro_batches]  # the policy that sampled
    step_tokens = sum(mb["completion_mask"].sum() for mb in micro_batches)
    step_sequences = sum(len(mb["advantages"]) for mb in micro_batches)
    losses = []
    for _ in range(cfg.num_iterations):
        total = 0.0
        for mb, old_logps in zip(micro_batches, old):
            logps = my_logps(model, mb, cfg.temperature)
            loss = my_loss(
                logps,
                old_logps,
                mb["advantages"],
                mb["completion_mask"],
                cfg.loss_type,
                step_tokens,
                step_sequences,
                cfg.epsilon,
            )
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


ANSWERS = {"10.1": my_advantages, "10.2": my_loss, "10.3": my_ssr_probabilities, "10.4": my_train_step}

# 10.Q: (1) 1: before the first update the policy is the one that sampled, so logp = old. (2) b: with a graph, old is
# logp itself, and exp(logp - old) has gradient 0: the weights do not move. (3) 40 = 30 + 10, the step's tokens.
selfcheck_10 = {1: 1, 2: "b", 3: 40}

ANSWERS["10.Q"] = selfcheck_10
