"""What real checkpoints exercise and the tiny default model does not, and TRL 1.16's current behaviour: masked KL,
resume onto another device, the lean-path probe, every EOS id, BOS, unscorable completions, the KL gradient, dropout,
bf16 upcasting, rank-wide generation decisions, warm-up and the reward plumbing."""
import math
import warnings

import pytest
import torch

import grpo_ssr as g


def _scripted_sampler(monkeypatch, end_at, eos, other=7):
    """Replace the sampler: row r draws `other` until step end_at[r], where it draws eos[r] (or eos, an int)."""
    state = {"t": 0}
    end_at = torch.as_tensor(end_at)
    eos = torch.as_tensor(eos).expand_as(end_at)

    def scripted(logits, temperature=1.0):
        t = state["t"]
        state["t"] += 1
        rows = logits.size(0)
        ends = end_at.repeat(rows // len(end_at) + 1)[:rows]
        return torch.where(ends == t, eos.repeat(rows // len(end_at) + 1)[:rows], other)

    real_generate = g.generate_completions

    def generate(*a, **kw):  # each generation batch starts the script again
        state["t"] = 0
        return real_generate(*a, **kw)

    monkeypatch.setattr(g, "sample_next_token", scripted)
    monkeypatch.setattr(g, "generate_completions", generate)


# --- 1. no padded slot can make the loss non-finite ------------------------------------------------------------------

@pytest.mark.parametrize("loss_type", g.LOSS_TYPES)
@pytest.mark.parametrize("bias_correction", [True, False])
def test_extreme_logps_at_padded_slots_change_nothing(loss_type, bias_correction):
    torch.manual_seed(0)
    logps = (-torch.rand(3, 5) * 3)
    old = logps + torch.randn(3, 5) * 0.2
    ref = logps + torch.randn(3, 5) * 0.3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    pad = ~mask.bool()
    kw = dict(beta=0.1, loss_type=loss_type, max_completion_length=5, use_bias_correction_kl=bias_correction)

    def loss_and_grad(lp, o, r):
        lp = lp.clone().requires_grad_()
        loss, stats = g.grpo_loss(lp, o, torch.tensor([1.0, -0.5, 2.0]), mask, ref_per_token_logps=r, **kw)
        loss.backward()
        return loss, lp.grad, stats

    clean = loss_and_grad(logps, old, ref)
    # -1000 is what a policy gives the pad token at a low temperature; repad stores 0 for ref and old there
    planted = loss_and_grad(logps.masked_fill(pad, -1000.0), old.masked_fill(pad, 0.0), ref.masked_fill(pad, 0.0))
    assert torch.isfinite(planted[0]) and torch.isfinite(planted[1]).all()
    assert planted[0].item() == pytest.approx(clean[0].item(), rel=1e-6)
    assert torch.allclose(planted[1], clean[1]) and (planted[1][pad] == 0).all()
    assert planted[2]["kl"].item() == pytest.approx(clean[2]["kl"].item(), rel=1e-6)


def test_beta_training_steps_stay_finite_with_extreme_padded_logps(cfg_factory, monkeypatch):
    """The real train_step with beta > 0: completions of unequal length (scripted EOS), and a policy whose log-prob
    at every padded slot is -1000 (as a low temperature gives the pad token). No step may become non-finite."""
    trainer = g.GRPOTrainer(cfg_factory(beta=0.1, max_steps=3, temperature=0.5))
    _scripted_sampler(monkeypatch, [2, 5, 9, 15], trainer.tokenizer.eos_token_id)
    real = g.per_token_logps

    def planted(model, input_ids, attention_mask, logits_to_keep, *a, **kw):
        lp = real(model, input_ids, attention_mask, logits_to_keep, *a, **kw)
        return lp.masked_fill(attention_mask[:, -logits_to_keep:] == 0, -1000.0)

    monkeypatch.setattr(g, "per_token_logps", planted)
    for _ in range(3):
        m = trainer.train_step()
        assert math.isfinite(m["loss"]) and math.isfinite(m["kl"]) and m["skipped"] == 0, m
    assert trainer.counters["nonfinite_steps"] == 0


# --- 2. resume keeps the buffer's sampler on the CPU -----------------------------------------------------------------

@pytest.mark.parametrize("buffer", ["SSRReplayBuffer", "ReplayBuffer"])
def test_checkpoint_loads_with_a_non_cpu_map_location(cfg_factory, monkeypatch, buffer):
    """As on CUDA: every tensor torch.load would place on the trainer's device goes to `meta` instead. The
    generator state and the priorities must still be read onto the CPU, and training must go on."""
    cfg = cfg_factory(replay_buffer_class=buffer, max_steps=2, save_steps=2)
    g.run(cfg)
    ckpt = str(g.Path(cfg.output_dir) / "checkpoint-2")
    trainer = g.GRPOTrainer(g.dataclasses.replace(cfg, max_steps=4, resume_from_checkpoint=ckpt))
    real_load = torch.load

    def load_as_if_on_gpu(f, *a, map_location=None, **kw):
        if map_location != "cpu":  # the trainer's device: pretend it is not the CPU
            map_location = "meta"
        return real_load(f, *a, map_location=map_location, **kw)

    monkeypatch.setattr(torch, "load", load_as_if_on_gpu)
    trainer.load_checkpoint(g.Path(cfg.output_dir) / "checkpoint-2")
    monkeypatch.setattr(torch, "load", real_load)
    assert trainer.buffer.generator.get_state().device.type == "cpu"
    if buffer == "SSRReplayBuffer":
        assert trainer.buffer.priorities.device.type == "cpu"
    assert all(v.device.type == "cpu" for s in trainer.buffer.slots if s is not None
               for v in s.values() if isinstance(v, torch.Tensor))
    m = trainer.train_step()
    assert m["step"] == 3 and math.isfinite(m["loss"])


# --- 3. the lean path is probed, not guessed from config names -------------------------------------------------------

def _falcon_h1(multiplier):
    from transformers import FalconH1Config, FalconH1ForCausalLM

    torch.manual_seed(0)
    return FalconH1ForCausalLM(FalconH1Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_n_groups=1,
        mamba_chunk_size=16, lm_head_multiplier=multiplier))


def _recurrent_gemma(cap):
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    torch.manual_seed(0)
    return RecurrentGemmaForCausalLM(RecurrentGemmaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, lru_width=64, attention_window_size=16, head_dim=16, logits_soft_cap=cap))


def _full_logits_logps(model, ids, attn, keep, temperature):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=g.positions_from_mask(attn),
                       use_cache=False).logits[:, -keep - 1:-1]
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids[:, -keep:, None]).squeeze(-1)


@pytest.mark.parametrize("build,post,neutral", [(_falcon_h1, 5.0, 1.0), (_recurrent_gemma, 30.0, 1e6)],
                         ids=["falcon_h1-lm_head_multiplier", "recurrent_gemma-logits_soft_cap"])
def test_models_that_post_process_logits_take_the_full_path(build, post, neutral, monkeypatch):
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    attn = torch.ones_like(ids)
    attn[0, :3] = 0
    model = build(post)
    # the mismatch is real: the head alone gives other log-probs than the model's own logits
    head_only = g.chunked_head_logps(model.model(input_ids=ids, attention_mask=attn,
                                                 position_ids=g.positions_from_mask(attn), use_cache=False)
                                     .last_hidden_state[:, -5:-1], model.lm_head, ids[:, -4:], 0.7, 512).detach()
    full = _full_logits_logps(model, ids, attn, 4, 0.7)
    assert (head_only - full).abs().max() > 1e-3
    # ... and the probe catches it: per_token_logps equals the full-logits path
    calls = []
    real_probe = g._lean_matches_full
    monkeypatch.setattr(g, "_lean_matches_full", lambda *a, **k: calls.append(1) or real_probe(*a, **k))
    assert g._lean_head(model) is None
    for _ in range(2):
        assert torch.allclose(g.per_token_logps(model, ids, attn, 4, 0.7).detach(), full, atol=1e-5)
    assert len(calls) == 1  # probed once per model
    # the same architecture without post-processing keeps the lean path
    plain = build(neutral)
    assert g._lean_head(plain) is plain.lm_head
    assert torch.allclose(g.per_token_logps(plain, ids, attn, 4, 0.7).detach(),
                          _full_logits_logps(plain, ids, attn, 4, 0.7), atol=1e-5)


# --- 4. every EOS id -------------------------------------------------------------------------------------------------

def test_every_eos_id_ends_a_completion_and_is_kept_in_the_saved_config(tiny, monkeypatch, tmp_path):
    model, tok = tiny
    model = g.copy.deepcopy(model)
    im_end = 65  # a second end-of-turn id, as Qwen2-Instruct's <|im_end|> beside <|endoftext|>
    model.generation_config.eos_token_id = [im_end, tok.eos_token_id]
    g.reset_generation_config(model, tok)
    assert g.eos_token_ids(model, tok) == [tok.eos_token_id, im_end]
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    loaded, ltok = g.load_model(str(tmp_path / "m"))
    assert sorted(g.eos_token_ids(loaded, ltok)) == sorted([tok.eos_token_id, im_end])
    # rows end at steps 1, 3 (the second id) and 2 (the tokenizer's); the last never ends
    _scripted_sampler(monkeypatch, [1, 3, 2, 99], [im_end, im_end, tok.eos_token_id, im_end])
    out = g.generate_completions(model, tok, ["x"], 4, 16, 8)
    assert out["completion_mask"].sum(1).tolist() == [2, 4, 3, 8]
    assert (out["completion_ids"][0, 2:] == tok.pad_token_id).all()
    assert g.completion_mask_from_eos(torch.tensor([[1, im_end, 2, 3]]), [tok.eos_token_id, im_end]).tolist() == \
        [[1, 1, 0, 0]]


# --- 5. BOS ----------------------------------------------------------------------------------------------------------

def _tokenizer_with_bos():
    from tokenizers import processors

    tok = g.build_tiny_tokenizer()
    tok.add_special_tokens({"bos_token": "<|bos|>"})
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", tok.bos_token_id)])
    tok.chat_template = "{{ bos_token }}" + g.TINY_CHAT_TEMPLATE  # as Llama's: the template writes the BOS
    return tok


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_prompts_start_with_exactly_one_bos(cfg_factory, chat):
    tok = _tokenizer_with_bos()
    assert tok("ab").input_ids[0] == tok.bos_token_id  # the tokenizer adds a BOS by default
    torch.manual_seed(0)
    model = g.build_tiny_model(len(tok))
    rows = [{"prompt": [{"role": "user", "content": f"hi {i}"}] if chat else f"post {i}: TL;DR:"} for i in range(4)]
    trainer = g.GRPOTrainer(cfg_factory(), model=model, tokenizer=tok, dataset=rows)
    for s in trainer.generate_batch():
        prompt = s["prompt_ids"][s["prompt_mask"].bool()].tolist()
        assert prompt[0] == tok.bos_token_id and prompt.count(tok.bos_token_id) == 1, prompt


# --- 6. unscorable completions ---------------------------------------------------------------------------------------

def test_unscorable_rewards_are_left_out_of_the_group_statistics():
    nan = math.nan
    rewards = torch.tensor([1.0, nan, 3.0, 8.0, nan, nan, nan, nan, 2.0, nan, 2.0, 5.0])
    adv = g.group_advantages(rewards, 4, scale_rewards=True)
    # group 1: scored 1, 3, 8: mean 4, unbiased std sqrt((9 + 1 + 16) / 2) = sqrt(13); the NaN gets exactly 0
    s = math.sqrt(13) + 1e-4
    assert adv[:4].tolist() == pytest.approx([-3 / s, 0.0, -1 / s, 4 / s], abs=1e-6)
    assert adv[1] == 0 and (adv[4:8] == 0).all()  # a group with nothing scored teaches nothing
    s = math.sqrt(3) + 1e-4  # group 3: scored 2, 2, 5: mean 3, unbiased std sqrt((1 + 1 + 4) / 2)
    assert adv[8:].tolist() == pytest.approx([-1 / s, 0.0, -1 / s, 2 / s], abs=1e-6)
    assert g.zero_spread_groups(rewards, 4).tolist() == [False, True, False]
    assert g.zero_spread_groups(torch.tensor([nan, 1.0, 1.0, nan]), 4).tolist() == [True]


def test_unscorable_completions_get_nan_reward_zero_advantage_and_are_never_replayed(cfg_factory):
    def every_fourth_unscored(completions, **kw):
        return [None if i % 4 == 0 else -abs(20 - len(c)) for i, c in enumerate(completions)]

    def also_none_there(completions, **kw):
        return [math.nan if i % 4 == 0 else 0.0 for i in range(len(completions))]

    trainer = g.GRPOTrainer(cfg_factory(max_steps=2), reward_funcs=[every_fourth_unscored, also_none_there])
    with pytest.warns(UserWarning, match="every_fourth_unscored"):
        samples = trainer.generate_batch()
    texts = [trainer.tokenizer.decode(s["completion_ids"][s["completion_mask"].bool()], skip_special_tokens=True)
             for s in samples]
    rewards = torch.tensor([math.nan if i % 4 == 0 else -abs(20 - len(t)) for i, t in enumerate(texts)])
    assert trainer.last_gen_metrics["reward"] == pytest.approx(rewards.nanmean().item(), rel=1e-5)
    assert trainer.last_gen_metrics["frac_reward_unscorable"] == 0.25
    adv = torch.stack([s["advantages"] for s in samples])
    assert (adv[::4] == 0).all()
    for grp in range(2):
        scored = rewards[grp * 4 + 1:grp * 4 + 4]
        if scored.max() > scored.min():
            expected = (scored - scored.mean()) / (scored.std() + 1e-4)
            assert torch.allclose(adv[grp * 4 + 1:grp * 4 + 4], expected, atol=1e-5)
    trainer.buffer.add(samples)
    held = {s["uid"] for s in trainer.buffer.slots if s is not None}
    assert not held & {samples[i]["uid"] for i in range(0, 8, 4)}


# --- 7. the KL gradient --------------------------------------------------------------------------------------------

def _expected_kl_gradient(use_bias_correction_kl: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact expectation, over tokens y ~ pi, of the gradient of the per-token KL term at pi = pi_old (one
    token position, a 5-token vocabulary), and the gradients of the true reverse and forward KL."""
    theta = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 1.0, 0.5, -0.5, 2.0], dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    p = logp.exp().detach()
    total = 0.0
    for y in range(5):  # the expectation, exactly: sum over y of pi(y) * per-token loss of sampling y
        lp = logp[y].view(1, 1)
        loss, _ = g.grpo_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 1), beta=1.0,
                              ref_per_token_logps=ref[y].view(1, 1), loss_type="bnpo",
                              use_bias_correction_kl=use_bias_correction_kl)
        total = total + p[y] * loss
    (grad,) = torch.autograd.grad(total, theta)
    logp = torch.log_softmax(theta, -1)
    reverse = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)[0]  # KL(pi || ref)
    forward = torch.autograd.grad((ref.exp() * (ref - torch.log_softmax(theta, -1))).sum(), theta)[0]  # KL(ref || pi)
    return grad, reverse, forward


def test_bias_corrected_k3_gives_the_reverse_kl_gradient_plain_k3_the_forward():
    grad, reverse, forward = _expected_kl_gradient(True)
    assert torch.allclose(grad, reverse, atol=1e-12) and not torch.allclose(grad, forward, atol=1e-3)
    grad, reverse, forward = _expected_kl_gradient(False)
    assert torch.allclose(grad, forward, atol=1e-12) and not torch.allclose(grad, reverse, atol=1e-3)


def test_bias_correction_multiplies_k3_by_the_ratio_hand_computed():
    logps = torch.log(torch.tensor([[0.5, 0.25]]))
    old = torch.log(torch.tensor([[0.25, 0.25]]))  # ratios 2 and 1
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    mask = torch.ones(1, 2)
    k3 = [0.5 + math.log(2) - 1, 2 - math.log(2) - 1]
    kw = dict(beta=0.1, ref_per_token_logps=ref, loss_type="bnpo", epsilon_low=10.0)
    with_ratio, stats = g.grpo_loss(logps, old, torch.tensor([0.0]), mask, use_bias_correction_kl=True, **kw)
    assert with_ratio.item() == pytest.approx(0.1 * (2 * k3[0] + k3[1]) / 2, rel=1e-6)
    plain, _ = g.grpo_loss(logps, old, torch.tensor([0.0]), mask, use_bias_correction_kl=False, **kw)
    assert plain.item() == pytest.approx(0.1 * (k3[0] + k3[1]) / 2, rel=1e-6)
    assert stats["kl"].item() == pytest.approx(sum(k3) / 2, rel=1e-6)  # the logged KL is plain k3


def test_bias_correction_is_a_config_field_passed_to_the_loss(cfg_factory, monkeypatch):
    names = [f.name for f in g.dataclasses.fields(g.GRPOConfig)]
    assert names[names.index("beta") + 1] == "use_bias_correction_kl"  # beside beta, among the algorithm's settings
    assert "use_bias_correction_kl" in {f.name for f in g.dataclasses.fields(g.AlgorithmConfig)}
    assert g.GRPOConfig().use_bias_correction_kl is True
    assert g.parse_args(["--use_bias_correction_kl", "false"]).use_bias_correction_kl is False
    seen = []
    real = g.grpo_loss
    monkeypatch.setattr(g, "grpo_loss", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    for value in (True, False):
        g.GRPOTrainer(cfg_factory(beta=0.1, use_bias_correction_kl=value)).train_step()
        assert seen[-1]["use_bias_correction_kl"] is value and seen[-1]["loss_type"] == "dapo"


# --- 8. TRL's current default loss ---------------------------------------------------------------------------------

def test_default_loss_type_is_dapo():
    assert g.GRPOConfig().loss_type == "dapo"
    logps = torch.log(torch.tensor([[0.3, 0.1, 0.2]]))
    mask = torch.tensor([[1, 1, 0]])
    default, _ = g.grpo_loss(logps, logps, torch.tensor([1.0]), mask)
    dapo, _ = g.grpo_loss(logps, logps, torch.tensor([1.0]), mask, loss_type="dapo", num_items_in_batch=2.0)
    assert default.item() == dapo.item() == pytest.approx(-1.0)


# --- 10. dropout, bf16 upcast, generation decided by all ranks, warm-up ----------------------------------------------

def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=258, n_positions=128, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3, bos_token_id=256,
                                      eos_token_id=256))


@pytest.mark.parametrize("disable", [True, False])
def test_dropout_is_disabled_in_the_policy(cfg_factory, disable):
    tok = g.build_tiny_tokenizer()
    trainer = g.GRPOTrainer(cfg_factory(disable_dropout=disable, max_prompt_length=64), model=_tiny_gpt2(),
                            tokenizer=tok)  # 64 + 16 tokens fit its 128 positions
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    trainer.model.train()
    with torch.no_grad():
        a, b = (g.per_token_logps(trainer.model, ids, torch.ones_like(ids), 6) for _ in range(2))
    assert torch.equal(a, b) is disable  # with dropout on, two training forwards differ


def test_full_logits_path_upcasts_bf16_before_the_temperature(monkeypatch):
    tok = g.build_tiny_tokenizer()
    torch.manual_seed(0)
    model = g.build_tiny_model(len(tok))
    with torch.no_grad():
        model.lm_head.weight.mul_(200)  # logits in the tens, where bf16 rounding of logits / T shows
    model = model.to(torch.bfloat16)
    monkeypatch.setattr(g, "_lean_head", lambda model: None)  # take the full-logits path
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=g.positions_from_mask(attn)).logits
        got = g.per_token_logps(model, ids, attn, 5, temperature=0.7)
    expected = torch.log_softmax(logits[:, -6:-1].float() / 0.7, -1).gather(-1, ids[:, -5:, None]).squeeze(-1)
    assert torch.allclose(got, expected, atol=1e-5)


def test_generation_is_decided_by_all_ranks_together(cfg_factory, monkeypatch):
    """num_iterations 2: this rank would reuse its batch on step 2, but another rank must generate (its buffer
    ran dry): so this rank generates too, and both walk the prompt order in step."""
    trainer = g.GRPOTrainer(cfg_factory(num_iterations=2, replay_buffer_class="ReplayBuffer"))
    assert trainer.train_step()["generated"] == 1
    real = trainer.dist.reduce
    calls = []
    monkeypatch.setattr(trainer.dist, "reduce", lambda values, op="sum": calls.append((list(values), op)) or (
        [1.0] if op == "max" and len(calls) == 1 else real(values, op)))
    before = trainer.prompt_sampler.state_dict()
    m = trainer.train_step()
    assert calls[0] == ([0.0], "max")  # this rank alone would not have generated
    assert m["generated"] == 1 and trainer.prompt_sampler.state_dict() != before


def test_warmup_matches_hf_linear_schedule(cfg_factory):
    from transformers import get_linear_schedule_with_warmup

    trainer = g.GRPOTrainer(cfg_factory(max_steps=10, warmup_steps=4))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf = get_linear_schedule_with_warmup(opt, 4, 10)
    assert [trainer._lr_factor(s) for s in range(10)] == pytest.approx([f(s) for s in range(10)
                                                                        for f in hf.lr_lambdas])
    assert trainer.scheduler.get_last_lr()[0] == 0.0  # the first step trains at learning rate 0, as HF's


# --- reward plumbing (from issue 16) -------------------------------------------------------------------------------

def test_infinite_reward_is_an_error_naming_the_function(cfg_factory):
    def explosive(completions, **kw):
        return [math.inf] + [0.0] * (len(completions) - 1)

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[explosive])
    with pytest.raises(ValueError, match="'explosive'.*infinite"):
        trainer.train_step()


def test_all_none_batch_says_so_when_the_step_is_skipped(cfg_factory, capsys):
    def never_scores(completions, **kw):
        return [None] * len(completions)

    trainer = g.GRPOTrainer(cfg_factory(max_generation_retries=1), reward_funcs=[never_scores])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = trainer.train_step()
        trainer.train_step()
    assert m["skipped"] == 1 and m["frac_reward_unscorable"] == 1.0 and len(trainer.buffer) == 0
    err = capsys.readouterr().err
    assert "returned None for every completion" in err and "zero reward spread" not in err
    assert sum("never_scores" in str(w.message) for w in caught) == 1  # warned once, over 4 batches


def test_reward_functions_receive_completion_ids(cfg_factory, monkeypatch):
    seen = {}

    def by_tokens(completions, completion_ids, **kw):
        seen["ids"], seen["texts"] = completion_ids, completions
        return [float(len(ids)) for ids in completion_ids]

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[by_tokens])
    _scripted_sampler(monkeypatch, [0, 3, 99, 5], trainer.tokenizer.eos_token_id, other=ord("a"))
    samples = trainer.generate_batch()
    eos = trainer.tokenizer.eos_token_id
    assert [len(i) for i in seen["ids"][:4]] == [1, 4, 16, 6]  # padding removed; a sampled EOS ends the list
    assert seen["ids"][1] == [97, 97, 97, eos] and seen["texts"][1] == "aaa"
    assert all(isinstance(t, int) for ids in seen["ids"] for t in ids)
    assert [s["completion_mask"].sum().item() for s in samples[:4]] == [1, 4, 16, 6]
