"""A small Llama-family causal LM from Hugging Face transformers (random weights, nothing
downloaded), its data and the plain-torch reference, shared by test_transformers.py and
hf_worker.py."""

import copy

import torch

STEPS, GLOBAL_BATCH, SEQ, VOCAB, HIDDEN = 5, 4, 16, 128, 32


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def make_model(seed=0, dtype=None):
    """The model; ``dtype`` (torch.bfloat16, say): built in it, as from_pretrained builds a
    model of that dtype (buffers such as the rotary frequencies stay fp32)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(seed)
    if dtype is None:
        return LlamaForCausalLM(llama_config())
    return AutoModelForCausalLM.from_config(llama_config(), dtype=dtype)


def config(global_batch, lr=1e-3):
    return {
        "train_batch_size": global_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
    }


def batches(steps, batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randint(0, VOCAB, (batch, SEQ), generator=g)


def reference(steps=STEPS, batch=GLOBAL_BATCH, lr=1e-3):
    """Losses and final model of torch.optim.AdamW on the same model and data."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for ids in batches(steps, batch):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, copy.deepcopy(model)
