"""What the Hugging Face examples share (huggingface.py, hf_trainer.py, peft_lora.py): a
stand-in for a downloaded checkpoint and generated training text. Nothing is downloaded."""

import os
import time

import torch


def base_model(out, rank, dtype=None):
    """The directory ``<out>.base`` holding a small random Llama that transformers' own
    save_pretrained wrote (in real use: a directory you downloaded). Rank 0 writes it once,
    whole or not at all; every rank returns once it is there."""
    import transformers

    path = out + ".base"
    if rank == 0 and not os.path.isdir(path):
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       tie_word_embeddings=True, pad_token_id=0)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, **({"dtype": dtype} if dtype else {}))
        model.save_pretrained(path + ".tmp")
        os.replace(path + ".tmp", path)
    end = time.time() + 120.0
    while not os.path.exists(path):
        if time.time() > end:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.1)
    return path


def counting_rows(rows, seq=32, seed=1):
    """Generated text: each row counts up from a random start (mod 255, 0 is padding), so the
    next token is learnable."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 255, (rows, 1), generator=g)
    return (start + torch.arange(seq)) % 255 + 1


def batches(steps, batch, seq, rank, world):
    """``steps`` global batches of counting rows; each rank takes its ``batch`` rows."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        start = torch.randint(0, 255, (batch * world, 1), generator=g)
        ids = (start + torch.arange(seq)) % 255 + 1
        yield ids[rank * batch : (rank + 1) * batch]
