"""Notebook 03 · the GRPO loss: solutions."""

import math

import torch

# 03.1: (a) A = +1, rho = 1.5: min(1.5, 1.2) = 1.2, the clipped branch, which does not depend on rho: gradient 0.
#       (b) A = -1, rho = 1.5: min(-1.5, -1.2) = -1.5, the unclipped branch rho * A: gradient A = -1.
objective_3_1 = ((1.2, 0.0), (-1.5, -1.0))

# 03.2: d = log pi_ref - log pi = -1; k3 = exp(d) - d - 1 = exp(-1).
d = -2.0 - (-1.0)
k3_3_2 = math.exp(d) - d - 1


# 03.3: the mean of the entries whose mask is 1; per row with dim=1, and 0 for a row with none.
def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


# 03.4: dapo under gradient accumulation: divide every micro-batch by the token count of the whole step, so the summed
# gradients equal one big batch's (dividing each by its own count, bnpo, weighs the tokens of a short micro-batch more).
def dapo_micro_batch_losses(per_token_losses: list, masks: list) -> list:
    step_tokens = sum(m.sum() for m in masks).clamp(min=1)
    return [(loss * m).sum() / step_tokens for loss, m in zip(per_token_losses, masks)]


# 03.Q: (1) on-policy the ratio is exactly 1 and no token is clipped: (1, 0). (2) dapo (d) divides by the step's
# tokens; bnpo by each micro-batch's, grpo per sequence, dr_grpo by a constant. (3) No (b): beta 0 needs no reference.
selfcheck_03 = {1: (1, 0), 2: "d", 3: "b"}

ANSWERS = {
    "03.1": objective_3_1,
    "03.2": k3_3_2,
    "03.3": masked_mean,
    "03.4": dapo_micro_batch_losses,
    "03.Q": selfcheck_03,
}
