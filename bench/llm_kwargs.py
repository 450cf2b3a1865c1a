"""Run a script (grpo_colocate.py or a bench/ script) with extra vLLM LLM() arguments, to measure an engine setting
without editing the script: LLM_KWARGS (json) is added to the arguments grpo_colocate.build_vllm passes (a dict is
merged into the one passed, e.g. compilation_config; the examples give vLLM's default graphs: compiled, prefill too).

    LLM_KWARGS='{"compilation_config": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}}' \\
        torchrun --nproc_per_node 1 bench/llm_kwargs.py bench/memory_probe.py --warmup
    LLM_KWARGS='{"compilation_config": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}}' \\
        torchrun --nproc_per_node 1 bench/llm_kwargs.py grpo_colocate.py --max_steps 40 --eval_steps 0
"""

import json
import os
import runpy
import sys

import vllm

EXTRA = json.loads(os.environ.get("LLM_KWARGS", "{}"))


class LLM(vllm.LLM):
    """vllm.LLM with EXTRA added: build_vllm imports LLM from vllm when it is called, so it gets this class."""

    def __init__(self, *args, **kwargs):
        for name, value in EXTRA.items():
            both_dicts = isinstance(value, dict) and isinstance(kwargs.get(name), dict)
            kwargs[name] = {**kwargs[name], **value} if both_dicts else value
        print(f"[llm_kwargs] LLM() gets {EXTRA}", flush=True)
        super().__init__(*args, **kwargs)


if __name__ == "__main__":
    vllm.LLM = LLM
    sys.argv = sys.argv[1:]  # the script and its own arguments
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
