"""A random-weight llama with SmolLM2's tokenizer and chat template, shaped like a 1.5B, 3B or 7B model: for timing
and memory runs (bench/README.md), not learning. Random weights almost never sample EOS, so every completion runs to
max_completion_length and every step does the same work. --eos_beta gives EOS a steady chance at every step instead,
for lengths like a real run's: a constant 0.05 in feature 0 of every token's embedding rides the residual stream to
the final norm, and the EOS row of the head reads it with weight beta (5: a mean of about 40% of 2,048 tokens, about
40% of the completions at the cap; bench/README.md gives the mix). The vocabulary is the tokenizer's (49,152) unless
the shape gives its own: `1.5b-qwen` has Qwen2.5's 151,936 rows, so that the logits, the log-prob pass and the sampler
cost what they cost at the users' scale; ids past the tokenizer's decode to nothing.

    python bench/random_model.py /tmp/random-1.5b 1.5b     # 1.39B params: 28 layers, hidden 1536, 12 / 2 heads
    python bench/random_model.py /tmp/random-1.5b-qwen 1.5b-qwen  # 1.54B params: the same with 151,936 tokens
    python bench/random_model.py /tmp/random-1.5b-qwen-b5 1.5b-qwen --eos_beta 5  # the same, stopping early
    python bench/random_model.py /tmp/random-3b 3b         # 3.1B params: 36 layers, hidden 2048, 16 / 2 heads
    python bench/random_model.py /tmp/random-7b 7b         # 6.9B params: 28 layers, hidden 3584, 28 / 4 heads
    python bench/random_model.py /tmp/tiny8 tiny8          # 13M params: 2 layers, hidden 256, 8 / 8 heads
                                                           # (bench/tp_sweep.py)
    python bench/random_model.py /tmp/tiny-moe tiny-qwen3-moe  # Qwen3-MoE: 4 layers, 8 experts, top 2 (GPU only)
    python bench/random_model.py /tmp/tiny-llama4 tiny-llama4  # Llama 4 text: 2 layers, 4 experts + a shared one
"""

import argparse
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import offline_model  # noqa: E402 (from the folder above, put on sys.path just above; the default model's tokenizer)

SHAPES = {  # Qwen2.5-1.5B / -3B / -7B layer shapes; the vocabulary is SmolLM2's where the shape gives none
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "3b": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "tiny8": dict(  # TP 1/2/4/8 on CPU
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
}

SHAPES["1.5b-qwen"] = {**SHAPES["1.5b"], "vocab_size": 151936}  # Qwen2.5's vocabulary (its qkv biases left out)
TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
SHAPES["tiny-qwen3-moe"] = dict(  # other architectures: their model_type (the rest: llama)
    model_type="qwen3_moe", num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, **TINY
)
SHAPES["tiny-qwen3-moe"] |= dict(intermediate_size=512, moe_intermediate_size=512)
SHAPES["tiny-llama4"] = dict(model_type="llama4_text", num_hidden_layers=2, num_local_experts=4, **TINY)
SHAPES["tiny-llama4"] |= dict(intermediate_size=512, intermediate_size_mlp=512)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("shape", choices=SHAPES)
    parser.add_argument("--eos_beta", type=float, help="EOS's weight on the constant feature (none: EOS almost never)")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(offline_model.build())
    shape = {"vocab_size": len(tokenizer), "model_type": "llama", **SHAPES[args.shape]}  # the shape's own values win
    cfg = AutoConfig.for_model(
        shape.pop("model_type"),
        max_position_embeddings=16384,  # prompt (<= 256) + completions of 8,192 tokens and more
        rope_theta=1e5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    if args.eos_beta is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight[:, 0] = 0.05  # [V, H]: every token carries the constant feature
            model.get_output_embeddings().weight[tokenizer.eos_token_id, 0] = args.eos_beta  # (tied: the same row)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
