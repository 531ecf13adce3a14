"""Notebook 04 · replay buffers and repad: solutions."""

import torch

adv = torch.tensor([2.0, -1.0, 1.0])

# 04.1: P(first) = |2|^alpha / sum |A|^alpha, for alpha = 1 and 2.
probs_4_1 = tuple((adv.abs() ** a / (adv.abs() ** a).sum())[0].item() for a in (1.0, 2.0))

# 04.2: ESS = 1 / sum P^2 at alpha = 1; with equal magnitudes every P is 1/3 and the ESS is the size, 3.
p = adv.abs() / adv.abs().sum()
ess_4_2 = ((1 / (p**2).sum()).item(), 3.0)


# 04.3: a freshness-aware SSR priority, |A|^alpha * exp(-age / tau) (as in arXiv 2604.16918), normalised.
def aged_probabilities(advantages: torch.Tensor, ages: torch.Tensor, alpha: float, tau: float) -> torch.Tensor:
    priority = advantages.abs().double() ** alpha * torch.exp(-ages.double() / tau)  # (N,)
    priority = torch.where(advantages == 0, 0.0, priority)  # 0 ** 0 is 1: a zero advantage still gets no draw
    return priority / priority.sum()


# 04.Q: (1) the 0 is turned away; P = 3 / (3 + 1) = 0.75. (2) num_iterations times: 2. (3) one draw per zero slot: 6.
selfcheck_04 = {1: 0.75, 2: 2, 3: 6}

ANSWERS = {"04.1": probs_4_1, "04.2": ess_4_2, "04.3": aged_probabilities, "04.Q": selfcheck_04}
