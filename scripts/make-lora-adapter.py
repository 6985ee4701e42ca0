"""A small random LoRA adapter (a PEFT directory: adapter_config.json and
adapter_model.safetensors) on a Hugging Face model directory, for tests of adapters as
models (tests/e2e/test_fleet_vllm.py).

    make-lora-adapter.py MODEL_DIR OUT_DIR [--seed N]

Rank 8 on q_proj and v_proj. PEFT's usual start leaves B at zero, an adapter that
changes nothing; here both matrices are random (init_lora_weights=False) from a fixed
seed and scaled up, so the adapter is the same on every machine and its answers differ
from the base's. Run with the vLLM venv's python (scripts/build-vllm-cpu installs peft there).
"""

import argparse
import shutil
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

# Scaling alpha/rank = 16: at PEFT's usual 2 the random matrices (nn.Linear's init) moved
# no greedy answer of SmolLM2-135M ("The capital of France is Paris." either way).
LORA_ALPHA = 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=LORA_ALPHA, target_modules=["q_proj", "v_proj"],
                      lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM")  # fmt: skip
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    get_peft_model(model, lora).save_pretrained(tmp)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (tmp / name).is_file():
            raise SystemExit(f"make-lora-adapter: PEFT wrote no {name} in {tmp}")
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)


if __name__ == "__main__":
    main()
