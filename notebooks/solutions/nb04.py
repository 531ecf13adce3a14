"""Notebook 04 · the GRPO loss: solutions."""

import math

import torch

# 04.1: (a) A = +1, rho = 1.5: min(1.5, 1.2) = 1.2, the clipped branch, which does not depend on rho: gradient 0.
#       (b) A = -1, rho = 1.5: min(-1.5, -1.2) = -1.5, the unclipped branch rho * A: gradient A = -1.
objective_4_1 = ((1.2, 0.0), (-1.5, -1.0))

# 04.2: d = log pi_ref - log pi = -1; k3 = exp(d) - d - 1 = exp(-1).
d = -2.0 - (-1.0)
k3_4_2 = math.exp(d) - d - 1


# 04.3: the mean of the entries whose mask is 1; per row with dim=1, and 0 for a row with none.
def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


# 04.4: loss_type "grpo": each sequence's mean over its own tokens, then the mean over sequences.
def sequence_mean_loss(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(per_token_loss, mask, dim=1).mean()


ANSWERS = {"04.1": objective_4_1, "04.2": k3_4_2, "04.3": masked_mean, "04.4": sequence_mean_loss}
