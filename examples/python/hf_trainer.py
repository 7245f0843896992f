"""Fine-tuning with Hugging Face's Trainer on Strata: StrataTrainer (docs/huggingface.md,
"Training with the Trainer"), run by tests/python/test_examples.py on a tiny random Llama so
that it stays true. Nothing is downloaded: the "pretrained" model is one this script first
writes with transformers' own save_pretrained (in real use, a directory you downloaded).

    PYTHONPATH=build/python .venv/bin/python examples/python/hf_trainer.py --out /tmp/trained
    PYTHONPATH=build/python .venv/bin/torchrun --nproc_per_node 2 examples/python/hf_trainer.py --out /tmp/trained

Trains 30 steps with a checkpoint at step 15, resumes a second run from it, saves the model.
Exit status 0 when the loss fell below 70% of the first, the resumed run's last loss is the
first run's, and the saved model, loaded with from_pretrained, gives the engine's logits.
"""

import argparse
import os
import tempfile

import torch
import transformers

from strata.integrations.transformers import StrataTrainer
from tiny_base import base_model, counting_rows


class Counting(torch.utils.data.Dataset):
    """Generated counting text (tiny_base.counting_rows), labels = inputs."""

    def __init__(self, rows, seq=32):
        self.ids = counting_rows(rows, seq)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LossLog(transformers.TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="where the trained model is saved (default: a temporary directory)")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    out = args.out or os.path.join(tempfile.gettempdir(), "strata-trainer-example-out")
    base = base_model(out, rank)  # written by rank 0, waited for by the others
    # [trainer]
    # A config written for the Trainer: "auto" values come from TrainingArguments.
    strata_config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    training_args = dict(
        output_dir=out + ".runs", per_device_train_batch_size=8 // world, gradient_accumulation_steps=2,
        max_steps=args.steps, learning_rate=3e-3, warmup_steps=3, lr_scheduler_type="cosine", max_grad_norm=1.0,
        logging_steps=1, save_strategy="steps", save_steps=args.steps // 2, report_to=[], use_cpu=True,
        dataloader_drop_last=True, disable_tqdm=True,
    )
    data = Counting(rows=16 * args.steps)

    def run(resume=None):
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
        log = LossLog()
        trainer = StrataTrainer(model=model, args=transformers.TrainingArguments(**training_args),
                                train_dataset=data, strata_config=strata_config, callbacks=[log])
        trainer.train(resume_from_checkpoint=resume)
        return trainer, log.losses

    trainer, losses = run()
    # A second run resumes from the checkpoint at the middle (checkpoint-15) to the end.
    resumed, resumed_losses = run(os.path.join(out + ".runs", f"checkpoint-{args.steps // 2}"))
    trainer.save_model(out)  # config.json and model.safetensors: from_pretrained loads them
    # [trainer]
    probe = Counting(rows=2).ids
    with torch.no_grad():
        want = trainer.engine(input_ids=probe).logits
    same_resume = resumed_losses[-1] == losses[-1]
    trainer.engine.close()
    resumed.engine.close()
    ok = losses[-1] < 0.7 * losses[0] and same_resume
    if rank == 0:
        back = transformers.AutoModelForCausalLM.from_pretrained(out)
        with torch.no_grad():
            same = torch.equal(back(input_ids=probe).logits, want)
        ok = ok and same
        print(f"hf_trainer.py: {world} rank(s), {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
              f"resumed at step {args.steps // 2} to the same last loss: {same_resume}, saved to {out}, "
              f"from_pretrained gives the engine's logits: {same}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
