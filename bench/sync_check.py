"""The weight-sync check where the weights surely move: the reward is a coin, crc32(completion) mod 2, so a group's
advantages are not all 0 even when every completion runs to the cap (a random model's). Pushed every step,
sampling/logp_diff stays at the kernels' rounding; with --stale, vLLM gets the weights at step 0 only (sleep mode
off, so that it keeps them), and logp_diff grows as the trainer moves away from what vLLM samples with.

    torchrun --nproc_per_node 1 bench/sync_check.py [--stale] -- --model /tmp/tiny-moe --learning_rate 1e-4
"""

import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_colocate as g  # noqa: E402 (from the folder above, put on sys.path just above)


def coin_reward(completions: list, **kwargs) -> list[float]:
    return [float(zlib.crc32(g.completion_text(c).encode()) % 2) for c in completions]


def push_at_the_first_step_only(push):
    """wake_and_push_weights that pushes once and then returns the names it loaded, leaving vLLM's weights alone."""
    loaded = []

    def push_once(llm, model, sleep_mode, wake_bytes=0):
        if not loaded:
            loaded.append(push(llm, model, sleep_mode, wake_bytes))
        return loaded[0]

    return push_once


if __name__ == "__main__":
    g.REWARD_FUNCS["coin"] = coin_reward
    ours = [arg for arg in sys.argv[1:] if arg not in ("--", "--stale")]  # (torchrun drops a "--" after the script)
    options = ["--reward_funcs", "coin", "--reward_weights", "1", *ours]
    if "--stale" in sys.argv[1:]:
        g.wake_and_push_weights = push_at_the_first_step_only(g.wake_and_push_weights)
        options += ["--vllm_enable_sleep_mode", "false"]
    g.main(options)
