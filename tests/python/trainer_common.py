"""What test_trainer.py and trainer_worker.py share: the data, the arguments, the Trainer
classes that record each micro-batch's loss, and the per-step losses."""

import pathlib
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import hf_model  # noqa: E402

STEPS, GAS, GLOBAL_MICRO = 20, 2, 2  # optimizer steps, accumulation, rows per micro-step (all ranks)


class Rows(torch.utils.data.Dataset):
    """STEPS x GAS x GLOBAL_MICRO rows of random tokens (labels = inputs: a causal LM)."""

    def __init__(self, seed=3):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, hf_model.VOCAB, (STEPS * GAS * GLOBAL_MICRO, hf_model.SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(output_dir, world=1, **overrides):
    from transformers import TrainingArguments

    kw = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=GLOBAL_MICRO // world,
        gradient_accumulation_steps=GAS,
        max_steps=STEPS,
        learning_rate=2e-3,
        weight_decay=0.01,
        max_grad_norm=0.5,
        lr_scheduler_type="linear",
        warmup_steps=3,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_drop_last=True,
        disable_tqdm=True,
    )
    kw.update(overrides)
    return TrainingArguments(**kw)


def recording(cls):
    """cls with each micro-batch's loss (as its training_step returns it) kept in
    ``micro_losses``."""

    class Recording(cls):
        micro_losses = None

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.micro_losses is None:
                self.micro_losses = []
            self.micro_losses.append(loss.item())
            return loss

    return Recording


def step_losses(micro, gas=GAS):
    """The loss of each optimizer step: its micro-batches' (normalized) losses summed."""
    return [sum(micro[k : k + gas]) for k in range(0, len(micro), gas)]
