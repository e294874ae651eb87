"""Write a tiny "pretrained" GPT-2 into a local directory with ``save_pretrained`` (from a config: no
download), to try a LoRA fine-tune on two tasks:

    python examples/tiny_pretrained.py /tmp/gpt2-tiny
    torchrun --standalone --nproc_per_node=2 launch/train.py model=hf model.pretrained=/tmp/gpt2-tiny \
        model.lora.r=4 data=multitask data.tasks.lm.weight=2 data.tasks.cls.weight=1 data.batch_size=12

The run fine-tunes LoRA adapters (the base frozen) and the classification head on a language-model task
and a sequence-classification task, one forward per task batch, and writes the adapter to
``RUN_DIR/hf/`` (load it with ``peft.PeftModel.from_pretrained(base, RUN_DIR/hf)``). With a real model,
point ``model.pretrained`` at its local directory instead.
"""

from __future__ import annotations

import sys


def write(path: str, seed: int = 123) -> None:
    """Save a 2-layer, 32-wide GPT-2 with a 64-token vocabulary (no dropout) to ``path``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    GPT2LMHeadModel(config).save_pretrained(path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/tiny_pretrained.py DIR")
    write(sys.argv[1])
    print(f"wrote {sys.argv[1]}")
