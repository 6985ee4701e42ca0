"""Convert a GGUF chat model to a Hugging Face directory vLLM serves (config, tokenizer
with its chat template, safetensors), without the hub.

    python scripts/convert-gguf-to-hf.py MODEL.gguf OUT_DIR [--dtype bfloat16]

Runs in the vLLM venv (scripts/build-vllm-cpu): it needs transformers, gguf, accelerate
and torch, which the project's own venv goes without. transformers reads the GGUF with
`gguf_file=` (dequantizing it); its `save_pretrained` refuses a model loaded so, so the
model is built again from the config and the state dict copied into it.
"""

import argparse
import sys
from pathlib import Path


def convert(gguf: Path, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    kw = {"gguf_file": gguf.name}
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch_dtype, **kw)
    config = AutoConfig.from_pretrained(str(gguf.parent), **kw)
    config.dtype = torch_dtype
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings may leave lm_head out of the state dict; anything else is an error.
    if unexpected or [k for k in missing if not k.startswith("lm_head.")]:
        raise SystemExit(f"convert: state dict mismatch: missing={missing} unexpected={unexpected}")
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(out), safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    if not tokenizer.chat_template:
        raise SystemExit(f"convert: {gguf.name} has no chat template")
    tokenizer.save_pretrained(str(out))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args(argv)
    if not args.gguf.is_file():
        print(f"convert: no such file: {args.gguf}", file=sys.stderr)
        return 2
    convert(args.gguf, args.out, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
