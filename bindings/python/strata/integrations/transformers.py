"""``StrataTrainer``: Hugging Face's ``transformers.Trainer`` training through a Strata engine.

The Trainer's loop, callbacks, logging, progress bar, data loading (sharded across ranks
under torchrun), evaluation and checkpoint folders stay the Trainer's; what a step does is
Strata's: ``strata.initialize`` makes the engine from the model, the Trainer's parameter
groups (no weight decay for biases and norms, as ``create_optimizer`` makes them) and the
Strata config with its ``"auto"`` values filled from ``TrainingArguments``; every micro-batch
runs ``engine.backward`` and ``engine.step`` (the engine accumulates gradients, clips and
applies CPU Adam at the boundary); the Trainer's optimizer and scheduler are stand-ins that
report the engine's learning rate and gradient norm.

docs/huggingface.md ("Training with the Trainer") has the fill table and the details.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict, List, Optional, Union

import torch
import transformers
import strata
from strata import _setup

__all__ = ["StrataTrainer", "fill_auto_values"]

_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused")
_TRAINING_ARGS_NAME = "training_args.bin"
# The client state key a Strata checkpoint in a checkpoint-N folder keeps the Trainer's
# schedule under (when the schedule is TrainingArguments', not the config's).
_SCHEDULE_KEY = "strata_trainer_lr_schedule"


def _load_config(config: Union[None, str, os.PathLike, Dict[str, Any]]) -> Dict[str, Any]:
    """strata_config as strata.initialize reads a config (a dict, a JSON string or a path),
    as a dict of its own (the Trainer fills "auto" values into it)."""
    if config is None:
        return {}
    text = _setup.read_config(config)
    try:
        out = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"StrataTrainer: strata_config is not JSON: {exc}") from None
    if not isinstance(out, dict):
        raise ValueError("StrataTrainer: strata_config holds no JSON object")
    return out


def _hidden_size(model: torch.nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    for key in ("hidden_size", "d_model", "n_embd"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    sizes = getattr(config, "hidden_sizes", None)
    return max(sizes) if sizes else None


def fill_auto_values(
    config: Dict[str, Any], args: "transformers.TrainingArguments", max_steps: int, model: torch.nn.Module
) -> Dict[str, Any]:
    """The config with its ``"auto"`` values filled from ``args`` as Hugging Face's DeepSpeed
    integration fills them (docs/huggingface.md has the table); a value given (not
    ``"auto"``) that disagrees with ``args`` raises ValueError listing each, as the
    integration does. Missing batch keys are added, and an ``optimizer`` section when there
    is none (AdamW with the args' hyperparameters). ``"auto"`` anywhere else is left for the
    config parser, which refuses it naming the key."""
    cfg = copy.deepcopy(config)
    world = args.world_size
    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    hidden = _hidden_size(model)
    table = [
        ("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size"),
        ("gradient_accumulation_steps", gas, "gradient_accumulation_steps"),
        ("train_batch_size", micro * gas * world, "world_size x per_device_train_batch_size x gradient_accumulation_steps"),
        ("gradient_clipping", args.max_grad_norm, "max_grad_norm"),
        ("optimizer.params.lr", args.learning_rate, "learning_rate"),
        ("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "[adam_beta1, adam_beta2]"),
        ("optimizer.params.eps", args.adam_epsilon, "adam_epsilon"),
        ("optimizer.params.weight_decay", args.weight_decay, "weight_decay"),
        ("scheduler.params.warmup_min_lr", 0, "0"),
        ("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate"),
        ("scheduler.params.warmup_num_steps", args.get_warmup_steps(max_steps), "warmup_steps (a fraction below 1: of max_steps)"),
        ("scheduler.params.total_num_steps", max_steps, "max_steps (the run's optimizer steps)"),
        ("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16 or fp16_full_eval"),
        ("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16 or bf16_full_eval"),
        ("zero_optimization.reduce_bucket_size", hidden * hidden if hidden else None, "hidden_size x hidden_size"),
        ("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden) if hidden else None,
         "0.9 x hidden_size x hidden_size"),
        ("zero_optimization.stage3_param_persistence_threshold", 10 * hidden if hidden else None, "10 x hidden_size"),
    ]
    if "optimizer" not in cfg:
        if args.optim not in _ADAMW and str(getattr(args.optim, "value", args.optim)) not in _ADAMW:
            raise ValueError(
                f"StrataTrainer: TrainingArguments.optim={args.optim!r}: Strata's optimizer is its CPU Adam; "
                f"use an AdamW optim ({', '.join(_ADAMW)}), or give the Strata config an optimizer section"
            )
        cfg["optimizer"] = {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}}
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        cfg.setdefault(key, "auto")
    if "gradient_clipping" not in cfg and args.max_grad_norm:
        cfg["gradient_clipping"] = "auto"
    for key in ("fp16", "bf16"):
        if key in cfg or getattr(args, key):
            cfg.setdefault(key, {}).setdefault("enabled", "auto")
    mismatches = []
    for key, value, source in table:
        *path, leaf = key.split(".")
        section = cfg
        for part in path:
            section = section.get(part) if isinstance(section, dict) else None
            if section is None:
                break
        if not isinstance(section, dict) or leaf not in section:
            continue
        if section[leaf] == "auto":
            if value is None:
                raise ValueError(
                    f"StrataTrainer: {key} is \"auto\", but the model has no config.hidden_size to fill it "
                    f"from ({source}); give a number"
                )
            section[leaf] = value
        elif value is not None and section[leaf] != value and not (
            isinstance(value, float) and isinstance(section[leaf], (int, float)) and float(section[leaf]) == value
        ):
            mismatches.append(f"- strata_config {key}={section[leaf]!r} vs TrainingArguments {source}={value!r}")
    if mismatches:
        raise ValueError(
            "StrataTrainer: the Strata config disagrees with TrainingArguments (set these to \"auto\" or to "
            "the same values):\n" + "\n".join(mismatches)
        )
    return cfg


class _EngineOptimizer:
    """The Trainer's optimizer: the engine applies the update in ``engine.step()`` (called by
    ``training_step``), so ``step`` and ``zero_grad`` have nothing left to do;
    ``param_groups`` are the engine's (their "lr" follows the engine)."""

    def __init__(self, engine: "strata.Engine"):
        self._engine = engine

    @property
    def param_groups(self) -> List[dict]:
        return self._engine.optimizer.param_groups

    def step(self, closure=None) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class _TrainingArgumentsSchedule:
    """TrainingArguments' schedule (``lr_scheduler_type``, warm-up) driving the engine: the
    Trainer's own scheduler, computed on a one-parameter stand-in optimizer, sets the
    engine's learning rate (``engine.set_lr``) after each applied step for the next one, so
    the rates are the Trainer's to the bit. A step the engine skipped (fp16 overflow) does
    not advance it, as the Trainer's does not."""

    def __init__(self, trainer: "StrataTrainer", max_steps: int):
        self._trainer = trainer
        self._stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=trainer.args.learning_rate)
        self._schedule = transformers.get_scheduler(
            trainer.args.lr_scheduler_type,
            optimizer=self._stand_in,
            num_warmup_steps=trainer.args.get_warmup_steps(max_steps),
            num_training_steps=max_steps,
            scheduler_specific_kwargs=trainer.args.lr_scheduler_kwargs,
        )
        self._apply()

    def _apply(self) -> None:
        self._trainer.engine.set_lr(self._schedule.get_last_lr()[0])

    def step(self, *args, **kwargs) -> None:
        if not self._trainer._strata_last_applied:
            return
        self._stand_in.step()  # nothing to update (no gradient); torch's schedulers expect it first
        self._schedule.step()
        self._apply()

    def get_last_lr(self) -> List[float]:
        return self._schedule.get_last_lr()

    def state_dict(self) -> dict:
        return self._schedule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._schedule.load_state_dict(state)
        self._apply()


class _ConfigSchedule:
    """The Strata config's ``scheduler`` section: the engine applies it at every step; this
    reports the rate of the last applied step (what the Trainer logs)."""

    def __init__(self, trainer: "StrataTrainer"):
        self._trainer = trainer

    def step(self, *args, **kwargs) -> None:
        pass

    def get_last_lr(self) -> List[float]:
        lr = self._trainer._strata_last_lr
        return [lr if lr is not None else self._trainer.engine.get_lr()[0]]

    def state_dict(self) -> dict:
        return self._trainer.engine.lr_scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._trainer.engine.lr_scheduler.load_state_dict(state)


class StrataTrainer(transformers.Trainer):
    """``transformers.Trainer`` on a Strata engine: the same constructor plus
    ``strata_config`` (a dict, a JSON string or the path of a JSON file; default ``{}``), in which
    ``"auto"`` values are filled from ``TrainingArguments`` (``fill_auto_values``).

    - The engine is made when training starts (``trainer.engine`` from then on; the model's
      parameters are the engine's: partitioned, gathered around their use).
    - Gradient accumulation, clipping (``max_grad_norm``) and the optimizer (CPU AdamW with
      the Trainer's parameter groups) are the engine's; the learning rate follows
      ``lr_scheduler_type`` and the warm-up of ``TrainingArguments``, or the config's
      ``scheduler`` section when it has one.
    - ``save_steps`` checkpoints: in each ``checkpoint-N`` folder the model as
      ``save_pretrained`` writes it (adapters only for a PEFT model), a Strata checkpoint
      (``global_step<N>`` and ``latest``: fp32 master, Adam states, schedule, per-rank RNG)
      and the Trainer's own state; ``train(resume_from_checkpoint=...)`` continues from it.
    - ``save_model(dir)`` writes the Hugging Face layout (``engine.save_pretrained``).
    - A custom ``optimizers=(...)`` or ``optimizer_cls_and_kwargs`` is refused: the update is
      Strata's.
    """

    def __init__(self, *args, strata_config: Union[None, str, os.PathLike, Dict[str, Any]] = None, **kwargs):
        optimizers = kwargs.get("optimizers")
        if optimizers is not None and any(o is not None for o in optimizers):
            raise ValueError(
                "StrataTrainer: optimizers=(...) is not supported: the engine's CPU Adam applies the update; "
                "configure it in strata_config's optimizer section (or TrainingArguments)"
            )
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError("StrataTrainer: optimizer_cls_and_kwargs is not supported: the update is Strata's")
        self._strata_config = _load_config(strata_config)
        self.engine: Optional[strata.Engine] = None
        self._strata_last_applied = False
        self._strata_last_lr: Optional[float] = None
        self._strata_grad_norm: Optional[float] = None
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "StrataTrainer: TrainingArguments enable DeepSpeed or FSDP; Strata is the engine here: "
                "leave deepspeed= and fsdp= unset"
            )

    # ------------------------------------------------------------------ the engine

    def _strata_param_groups(self) -> List[dict]:
        """The Trainer's parameter groups (create_optimizer's): weight decay for the
        parameters get_decay_parameter_names lists, none for the others (biases, norms)."""
        decay = set(self.get_decay_parameter_names(self.model))
        groups = [
            {"params": [p for n, p in self.model.named_parameters() if n in decay and p.requires_grad],
             "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in self.model.named_parameters() if n not in decay and p.requires_grad],
             "weight_decay": 0.0},
        ]
        return [g for g in groups if g["params"]]

    def _check_accumulation(self, train_dataloader, max_steps: int) -> None:
        """The engine applies a step every gradient_accumulation_steps backwards; the
        Trainer's last step of an epoch may have fewer batches: refused before training."""
        gas = self.args.gradient_accumulation_steps
        try:
            batches = len(train_dataloader)
        except TypeError:
            return  # an iterable dataset: checked at the step (training_step)
        if batches % gas and max_steps > batches // gas:
            raise ValueError(
                f"StrataTrainer: an epoch has {batches} batches per rank, not a multiple of "
                f"gradient_accumulation_steps={gas}: the Trainer would end the epoch with a shorter "
                f"accumulation, which the engine cannot apply; set dataloader_drop_last=True with a "
                f"dataset size that fills whole steps, or another gradient_accumulation_steps"
            )

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Makes the engine (once) in place of the Trainer's optimizer, scheduler and
        accelerator.prepare (no DDP wrapper: the engine reduces gradients itself)."""
        self._check_accumulation(train_dataloader, max_steps)
        if self.engine is None:
            config = fill_auto_values(self._strata_config, self.args, max_steps, self.model)
            self._strata_filled = config
            self.engine, _, _, _ = strata.initialize(
                model=self.model, config=config, model_parameters=self._strata_param_groups()
            )
        self.optimizer = _EngineOptimizer(self.engine)
        if self.engine.lr_scheduler is not None:
            self.lr_scheduler = _ConfigSchedule(self)
        else:
            self.lr_scheduler = _TrainingArgumentsSchedule(self, max_steps)
        self._created_lr_scheduler = True
        self.model_wrapped = self.engine
        if resume_from_checkpoint is not None:
            self._strata_load(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.engine, train_dataloader

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        # Evaluation and prediction run through the engine once it exists.
        return self.engine if self.engine is not None else super()._wrap_model(model, training, dataloader)

    # ------------------------------------------------------------------ a step

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's loss (``compute_loss``, normalized as the Trainer normalizes it for
        its backward), then ``engine.backward`` and ``engine.step``. The engine divides by
        gradient_accumulation_steps itself, so it gets the Trainer's loss times that (and
        averages gradients across ranks as DDP does)."""
        engine = self.engine
        gas = self.args.gradient_accumulation_steps
        if self.current_gradient_accumulation_steps != gas:
            raise ValueError(
                f"StrataTrainer: this optimizer step has {self.current_gradient_accumulation_steps} batches, "
                f"not gradient_accumulation_steps={gas} (the end of an epoch or of an iterable dataset): "
                f"the engine applies a step every {gas} backwards; use dataloader_drop_last=True with whole steps"
            )
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if (not self.model_accepts_loss_kwargs or num_items_in_batch is None) and self.compute_loss_func is None:
            loss = loss / self.current_gradient_accumulation_steps
        lr = engine.get_lr()[0]
        engine.backward(loss * gas)
        outcome = engine.step()
        if outcome["boundary"]:
            self._strata_last_applied = bool(outcome["applied"])
            self._strata_last_lr = lr
            norm = outcome.get("global_norm")
            self._strata_grad_norm = float(norm) if norm is not None and norm >= 0 else None
        return loss.detach()

    def _clip_grad_norm(self, model):
        # The engine clipped (gradient_clipping = max_grad_norm): its norm before clipping.
        return self._strata_grad_norm

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm if grad_norm is not None else self._strata_grad_norm

    def floating_point_ops(self, inputs) -> int:
        # The model's parameters hold nothing outside their use: count the engine's.
        if self.engine is None or not hasattr(self.model, "estimate_tokens"):
            return super().floating_point_ops(inputs)
        numel = sum(g["numel"] for g in self.engine.groups())
        return 6 * self.model.estimate_tokens(inputs) * numel

    # ------------------------------------------------------------------ saving and resuming

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Collective once training has started: the model in Hugging Face's layout
        (``engine.save_pretrained``; adapters only for a PEFT model; ``save_16bit_model``
        for a model that is not a transformers one), the processing class and the
        TrainingArguments (from the process that saves)."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if strata._model_io._is_peft_model(self.model) or hasattr(getattr(self.model, "config", None), "save_pretrained"):
            self.engine.save_pretrained(output_dir)
        else:
            self.engine.save_16bit_model(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, _TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """A Strata checkpoint in the checkpoint-N folder (collective): the master weights,
        Adam states, the engine's counters and schedule, per-rank RNG, and the Trainer's
        schedule when it drives the rate."""
        client = {}
        if isinstance(self.lr_scheduler, _TrainingArgumentsSchedule):
            client[_SCHEDULE_KEY] = self.lr_scheduler.state_dict()
        self.engine.save_checkpoint(output_dir, tag=self._checkpoint_tag(output_dir), client_state=client)

    def _checkpoint_tag(self, output_dir: str) -> str:
        """``global_step<N>``; when the folder already holds that (an earlier run reached
        the same step: a resumed run saves checkpoint-N again) ``global_step<N>.<k>``, a
        new tag, since a Strata checkpoint is never overwritten; ``latest`` moves to it.
        Rank 0 decides, every rank takes its answer."""
        base = f"global_step{self.state.global_step}"
        tag, k = base, 0
        while os.path.exists(os.path.join(output_dir, tag)):
            k += 1
            tag = f"{base}.{k}"
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            agreed = [tag]
            torch.distributed.broadcast_object_list(agreed, src=0)
            tag = agreed[0]
        return tag

    def _save_scaler(self, output_dir: str) -> None:
        pass  # the loss scale is in the Strata checkpoint

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Called by train() before the engine exists: only checks that the folder holds a
        Strata checkpoint (loaded once the engine is made)."""
        if not os.path.isfile(os.path.join(resume_from_checkpoint, "latest")):
            raise FileNotFoundError(
                f"StrataTrainer: {resume_from_checkpoint} holds no Strata checkpoint (no 'latest' file): "
                f"resume from a checkpoint-N folder a StrataTrainer saved"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        pass  # in the Strata checkpoint (_strata_load)

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        pass

    def _load_best_model(self) -> None:
        """load_best_model_at_end (and so EarlyStoppingCallback): the best checkpoint-N's
        model values into the engine (collective; the parameters and buffers only: the
        run is over, its optimizer states are not needed)."""
        if self.engine is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        self.engine.load_checkpoint(best, load_module_only=True, missing_ok=False)

    def _strata_load(self, checkpoint: str) -> None:
        self._load_from_checkpoint(checkpoint)
        _, client = self.engine.load_checkpoint(checkpoint, missing_ok=False)
        if isinstance(self.lr_scheduler, _TrainingArgumentsSchedule):
            state = (client or {}).get(_SCHEDULE_KEY)
            if state is None:
                raise ValueError(
                    f"StrataTrainer: the checkpoint in {checkpoint} has no TrainingArguments schedule (it was "
                    f"saved with a config scheduler section): resume with the same strata_config"
                )
            self.lr_scheduler.load_state_dict(state)
