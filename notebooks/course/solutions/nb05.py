"""Notebook 05 · one training step, by hand: solutions."""

# 05.Q: (1) a generation batch fills the step's micro-batches: 8 x 2 = 16 completions. (2) One AdamW step a train_step:
# the micro-batches' gradients add up before GRPOStep.update. (3) b: in plain GRPO every sample first trains in the
# step that made it, before any update, so its first training forward gives the old log-probs, detached.
selfcheck_05 = {1: 16, 2: 1, 3: "b"}

ANSWERS = {"05.Q": selfcheck_05}
