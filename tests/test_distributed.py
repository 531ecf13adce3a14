"""torchrun with 2 CPU processes (gloo): the CLI runs, ranks stay in step, N ranks equal one big batch, resume works."""

import json
from pathlib import Path

import pytest
import torch

from conftest import training_rows

pytestmark = pytest.mark.slow


def test_cli_under_torchrun_then_resume_from_a_two_rank_checkpoint(ddp_cli_runs):
    future, out, _ = ddp_cli_runs
    runs = future.result()
    assert runs["first"].returncode == 0, runs["first"].stderr[-3000:]
    full = training_rows(out / "first")  # the folder as the first launch left it
    assert [r["step"] for r in full] == [1, 2, 3, 4]  # one line per step, written by rank 0 alone
    assert all(r["completions"] == 16 for r in full)  # 8 completions from each of the 2 ranks
    ckpt = out / "first" / "checkpoint-2"
    assert (ckpt / "rank-0.pt").is_file() and (ckpt / "rank-1.pt").is_file()
    own = [torch.load(ckpt / f"rank-{r}.pt", weights_only=False) for r in (0, 1)]
    assert own[0]["buffer"]["size"] > 0 and own[1]["buffer"]["size"] > 0
    assert own[0]["rng"]["torch"].tolist() != own[1]["rng"]["torch"].tolist()  # sampling seeds differ per rank

    assert runs["resumed"].returncode == 0, runs["resumed"].stderr[-3000:]  # from checkpoint-2, under torchrun
    resumed = training_rows(out / "run")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full[2:], resumed[2:]):
        assert a["reward"] == b["reward"] and a["loss"] == b["loss"], (a, b)
    assert runs["one"].returncode == 2 and "same number" in runs["one"].stderr  # the same checkpoint in one process


@pytest.fixture(scope="module")
def launch(ddp_launch):
    """ddp_driver.py through every mode under torchrun (conftest's ddp_launch), and beside it the fixed mode in one
    process (world size 1). Each test reads its own mode's files, and says why when they are missing (a mode that
    hangs or raises ends the launch, and the modes after it never run)."""
    future, out = ddp_launch
    proc, single, single_err = future.result()

    def files(mode: str, *names: str) -> Path:
        missing = [name for name in names if not (out / mode / name).is_file()]
        why = f"the launch exited {proc.returncode}: {proc.stderr[-3000:]}"
        assert not missing, f"mode {mode} wrote no {', '.join(missing)}; {why}"
        if mode == "fixed":
            assert single.returncode == 0, (
                f"the fixed mode in one process exited {single.returncode}: {single_err[-3000:]}"
            )
        return out / mode

    return files


def test_parameters_identical_on_both_ranks(launch):
    out = launch("train", "params-0.pt", "params-1.pt")
    p0, p1 = (torch.load(out / f"params-{r}.pt") for r in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def test_dynamic_sampling_with_uneven_micro_batches_across_ranks(launch):
    """Rank 0 keeps 4 groups (2 micro-batches), rank 1 keeps 2 (1 micro-batch): every collective of the step must
    still have one shape on every rank, or the step hangs (bounded here by the launch's limit) or sums the wrong
    numbers."""
    out = launch("dynamic", "dynamic-0.pt", "dynamic-1.pt")
    r0, r1 = (torch.load(out / f"dynamic-{r}.pt", weights_only=False) for r in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    assert [m["skipped"] for m in r0["history"]] == [0, 0]
    assert [m["frac_batch_filled"] for m in r0["history"]] == [0.75, 0.75]  # (1 + 0.5) / 2: the ranks' mean


@pytest.fixture(scope="module")
def fixed(launch):
    """One step on the same 16 fixed completions of unequal lengths for each loss type: under torchrun, 8 per rank,
    and in one process on all 16 (and on each half alone), side by side."""
    names = [f"fixed-{t}-{w}.pt" for t in ("dapo", "grpo", "dr_grpo", "bnpo") for w in ("2", "1", "1x2")]
    out = launch("fixed", *names)
    return lambda loss_type, world: torch.load(out / f"fixed-{loss_type}-{world}.pt")


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_two_ranks_give_the_update_of_one_big_batch(fixed, loss_type):
    two, one = fixed(loss_type, 2), fixed(loss_type, 1)
    for a, b in zip(two["grads"], one["grads"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    assert sum(g.abs().sum() for g in one["grads"]) > 0
    # Adam's first step is about lr * sign(grad): compare the update where the gradient is clearly non-zero
    # (where it is ~1e-9, rounding can flip its sign and the update with it, with no bearing on correctness)
    for a, b, grad in zip(two["params"], one["params"], one["grads"]):
        clear = grad.abs() > 1e-5
        assert torch.allclose(a[clear], b[clear], atol=1e-6)


def test_bnpo_divides_each_rank_by_its_own_tokens(fixed):
    """As TRL: each rank's bnpo loss is divided by that rank's own token count and by the number of ranks, and the
    ranks' gradients are summed. So two
    ranks give the mean of each share's own bnpo gradient, which differs from one big batch's (the shares hold 37
    and 42 tokens)."""
    two, shares, big = (fixed("bnpo", w) for w in ("2", "1x2", "1"))
    for a, b in zip(two["grads"], shares["grads"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    assert not all(torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(two["grads"], big["grads"]))


def test_a_signal_on_one_rank_in_the_last_step_stops_every_rank_alike(launch):
    """Rank 1 alone is signalled during the last step. Every rank must still take the same branch, a checkpoint (three
    barriers) rather than the model (one): before the ranks agreed after the last step, the collectives fell out of
    step, and no checkpoint was written."""
    out = launch("signal", "exit-0.txt", "exit-1.txt")
    assert [(out / f"exit-{r}.txt").read_text() for r in (0, 1)] == ["143", "143"]  # 128 + SIGTERM on both
    ckpt = out / "run" / "checkpoint-3"
    assert (ckpt / "rank-0.pt").is_file() and (ckpt / "rank-1.pt").is_file()


def test_a_gradient_on_some_ranks_only_is_summed_in_step(launch):
    """A parameter that rank 1's forward never reaches (an unused expert) has no gradient there: rank 1 must still
    take part in the same reductions, and both ranks end with the same weights, that parameter moved by rank 0's."""
    out = launch("grad", "grad-0.pt", "grad-1.pt")
    p0, p1 = (torch.load(out / f"grad-{r}.pt") for r in (0, 1))
    assert all(torch.equal(p0[name], p1[name]) for name in p0)
    assert p0["extra"].item() != 0  # rank 0's gradient reached it on both ranks


def test_rank_0_empties_the_folder_only_after_every_rank_has_read_it(launch):
    """--overwrite_output_dir under torchrun: every rank reads the folder before a run starts, and rank 0 then empties
    it. Here rank 1 reads slowly, and rank 0 is made to wait half a second, as on a loaded machine: rank 0 must wait
    for rank 1, or rank 1 finds metrics.jsonl gone between seeing it and reading it (seen in CI)."""
    out = launch("overwrite", "overwrite-0.txt", "overwrite-1.txt")
    assert [(out / f"overwrite-{r}.txt").read_text() for r in (0, 1)] == ["1", "1"]  # the second run's one step


def test_every_rank_makes_the_same_collectives_in_every_branch(launch):
    """Skipped, empty and non-finite steps, dynamic sampling, evaluation, checkpoints, completions, a stop signal:
    each branch that one rank takes, every rank takes, so each rank's sequence of collectives (name, shape, dtype)
    is the same."""
    out = launch("collectives", "collectives-0.json", "collectives-1.json")
    logs = [json.loads((out / f"collectives-{r}.json").read_text()) for r in (0, 1)]
    assert logs[0] == logs[1]
    runs = [entry[1] for entry in logs[0] if entry[0] == "run"]
    assert len(runs) == 6 and len(logs[0]) > 100
    lines = training_rows(out / "run")  # the last run's: stopped after step 2 on both ranks
    assert [r["step"] for r in lines] == [1, 2]


def test_under_torchrun_a_mistake_is_one_line_from_one_rank(ddp_cli_runs):
    proc = ddp_cli_runs[2].result()  # --max_steps 0
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error: " in line]
    assert errors == ["error: --max_steps 0 is invalid: must be > 0"], proc.stderr[-2000:]
