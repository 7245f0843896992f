"""DeepSpeed's monitors for the Python engine: ``csv_monitor``, ``tensorboard`` and ``wandb``.

Rank 0 records, at every optimizer step, DeepSpeed's events (the step is the number of
samples trained, as in DeepSpeed):

- ``Train/Samples/train_loss``: the mean of the losses given to ``engine.backward`` in the
  step's micro-steps (this rank's; kept as a tensor until written: no device sync per step);
- ``Train/Samples/lr``: the learning rate the step applied;
- ``Train/Samples/loss_scale``: the loss scale (fp16 only, as DeepSpeed);

and, every ``steps_per_print`` steps, the interval's means per optimizer step:

- ``Train/Samples/elapsed_time_ms_forward`` / ``_backward`` / ``_step``: the phases (the
  names DeepSpeed gives its wall_clock_breakdown timers);
- ``Train/Samples/samples_per_sec``: samples trained per wall-clock second;
- ``Strata/wait_ms/all_gather``, ``Strata/wait_ms/reduce``, ``Strata/wait_ms/optimizer``,
  ``Strata/wait_ms/working_shard``: the engine's waits (``engine.statistics()``);
- ``Strata/model_tflops``: 6 x parameters x tokens per second / 1e12, when the forward's
  input is token ids (``input_ids=`` or a first positional integer tensor);
- ``Strata/host_rss_gib``, ``Strata/host_tier_gib``, ``Strata/device_tier_gib``,
  ``Strata/device_tier_peak_gib`` and, on CUDA, ``Strata/cuda_max_allocated_gib``.

Every ``steps_per_print`` steps the recorded events go to a background thread that writes
them, so the step never waits on a file or the network. A write that fails is raised by the
next ``engine.step()`` (or ``engine.close()``); ``close()`` writes whatever is left.
"""

from __future__ import annotations

import atexit
import csv
import importlib.util
import os
import queue
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

Event = Tuple[str, Any, int]  # (name, value: a number or a one-element tensor, step)


def _require(package: str, key: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ImportError(
            f"strata: {key}.enabled needs the {package} package, which is not installed: "
            f"pip install {package} (or set {key}.enabled to false)"
        )


def _log_dir(section: dict) -> str:
    return os.path.join(section.get("output_path") or "", section.get("job_name") or "DeepSpeedJobName")


class _Csv:
    """One file per event: <log_dir>/<name with / and spaces as _>.csv, rows step,value
    under a header ``step,<last part of the name>``, appended to across runs."""

    def __init__(self, section: dict):
        self.dir = _log_dir(section)
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            raise type(e)(e.errno, f"strata: csv_monitor.output_path/job_name: cannot make the directory "
                          f"{self.dir!r} ({e.strerror})") from e

    def write(self, events: List[Tuple[str, float, int]]) -> None:
        rows: Dict[str, List[Tuple[int, float]]] = {}
        for name, value, step in events:
            rows.setdefault(name, []).append((step, value))
        for name, values in rows.items():
            path = os.path.join(self.dir, name.replace("/", "_").replace(" ", "_") + ".csv")
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            with open(path, "a", newline="", encoding="utf-8") as f:
                w = csv.writer(f)
                if new:
                    w.writerow(["step", name.split("/")[-1]])
                w.writerows(values)

    def close(self) -> None:
        pass


class _TensorBoard:
    def __init__(self, section: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=_log_dir(section))

    def write(self, events) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, section: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=section.get("project") or "deepspeed",
                              group=section.get("group") or None, entity=section.get("team") or None)

    def write(self, events) -> None:
        by_step: Dict[int, Dict[str, float]] = {}
        for name, value, step in events:
            by_step.setdefault(step, {})[name] = value
        for step in sorted(by_step):
            self.run.log(by_step[step], step=step)

    def close(self) -> None:
        self.run.finish()


def _gib(n: float) -> float:
    return float(n) / 2**30


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Monitor:
    """The engine's monitors (one per engine). Active on global rank 0 (under an mpu the first
    model-parallel rank's data-parallel rank 0, as DeepSpeed) when any monitor is enabled;
    every rank checks that the enabled monitors' packages are installed (the same decision on
    every rank)."""

    def __init__(self, cfg: dict, rank: int, fp16: bool, train_batch_size: int, params: int):
        sections = {k: cfg.get(k) or {} for k in ("csv_monitor", "tensorboard", "wandb")}
        enabled = [k for k, s in sections.items() if s.get("enabled")]
        if "tensorboard" in enabled:
            _require("tensorboard", "tensorboard")
        if "wandb" in enabled:
            _require("wandb", "wandb")
        self.active = bool(enabled) and rank == 0
        self.every = max(1, int(cfg.get("steps_per_print", 10)))
        self.fp16 = fp16
        self.batch = train_batch_size
        self.params = params
        self.backends: list = []
        self.pending: List[Event] = []
        self.losses: List[torch.Tensor] = []
        self.tokens = 0
        self.error: Optional[BaseException] = None
        self.queue: "queue.Queue" = queue.Queue()
        self.thread: Optional[threading.Thread] = None
        self.last: Optional[dict] = None
        if not self.active:
            return
        makers = {"csv_monitor": _Csv, "tensorboard": _TensorBoard, "wandb": _Wandb}
        self.backends = [makers[k](sections[k]) for k in enabled]
        self.thread = threading.Thread(target=self._writer, name="strata-monitor", daemon=True)
        self.thread.start()
        atexit.register(Monitor._at_exit, weakref.ref(self))

    # ---------------------------------------------------------------- the step's side
    def record_forward(self, args, kwargs) -> None:
        """Counts the tokens of a training forward (for model TFLOPS)."""
        if not self.active:
            return
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor):
            ids = args[0]
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and not ids.is_complex():
            self.tokens += ids.numel()

    def record_loss(self, loss: torch.Tensor) -> None:
        if self.active:
            self.losses.append(loss.detach().reshape(()))

    def record_step(self, step: int, out: dict, stats_fn) -> None:
        """At an optimizer step (``out``: engine.step()'s dict); ``stats_fn`` gives
        engine.statistics() when this step writes."""
        if not self.active:
            return
        self._raise_pending()
        samples = step * self.batch
        if self.losses:
            loss = torch.stack(self.losses).float().mean()
            self.pending.append(("Train/Samples/train_loss", loss, samples))
            self.losses = []
        self.pending.append(("Train/Samples/lr", float(out["lr"]), samples))
        if self.fp16:
            self.pending.append(("Train/Samples/loss_scale", float(out["loss_scale"]), samples))
        if step % self.every == 0:
            self.pending.extend(self._interval(stats_fn(), samples))
            self.queue.put(self.pending)
            self.pending = []

    def _interval(self, stats: dict, samples: int) -> List[Event]:
        now = time.perf_counter()
        c, r, o = stats["coordinator"], stats["reducer"], stats["optimizer"]
        cur = {
            "steps": stats["global_steps"],
            "samples": samples,
            "tokens": self.tokens,
            "time": now,
            "forward": stats["phases"]["forward_s"],
            "backward": stats["phases"]["backward_s"],
            "step": stats["phases"]["step_s"],
            "all_gather": c["all_gather_wait_s"] + c["staging_wait_s"] + c["shard_read_wait_s"],
            "reduce": r["compute_wait_s"] + r["reduce_wait_s"] + r["shard_copy_wait_s"] + r["accumulate_wait_s"],
            "optimizer": o["pipelined_wait_s"] + o["pipelined_store_wait_s"],
            "working_shard": stats["working_push_wait_s"],
        }
        last, self.last = self.last, cur
        events: List[Event] = [
            ("Strata/host_rss_gib", _gib(_rss_bytes()), samples),
            ("Strata/host_tier_gib", _gib(stats["host"]["bytes_in_use"]), samples),
            ("Strata/device_tier_gib", _gib(stats["device"]["bytes_in_use"]), samples),
            ("Strata/device_tier_peak_gib", _gib(stats["device"]["peak_bytes"]), samples),
        ]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            events.append(("Strata/cuda_max_allocated_gib", _gib(torch.cuda.max_memory_allocated()), samples))
        if last is None or cur["steps"] <= last["steps"]:
            return events  # the first interval starts here: its rates come next time
        steps = cur["steps"] - last["steps"]
        seconds = cur["time"] - last["time"]

        def per_step_ms(key: str) -> float:
            return (cur[key] - last[key]) * 1000.0 / steps

        events += [
            ("Train/Samples/elapsed_time_ms_forward", per_step_ms("forward"), samples),
            ("Train/Samples/elapsed_time_ms_backward", per_step_ms("backward"), samples),
            ("Train/Samples/elapsed_time_ms_step", per_step_ms("step"), samples),
            ("Strata/wait_ms/all_gather", per_step_ms("all_gather"), samples),
            ("Strata/wait_ms/reduce", per_step_ms("reduce"), samples),
            ("Strata/wait_ms/optimizer", per_step_ms("optimizer"), samples),
            ("Strata/wait_ms/working_shard", per_step_ms("working_shard"), samples),
        ]
        if seconds > 0:
            events.append(("Train/Samples/samples_per_sec", (cur["samples"] - last["samples"]) / seconds, samples))
            tokens = cur["tokens"] - last["tokens"]
            if tokens > 0:
                events.append(("Strata/model_tflops", 6.0 * self.params * tokens / seconds / 1e12, samples))
        return events

    # ---------------------------------------------------------------- the writer thread
    def _writer(self) -> None:
        while True:
            batch = self.queue.get()
            try:
                if batch is None:
                    return
                if self.error is not None:
                    continue  # after a failure nothing more is written (the error is raised)
                events = [(n, float(v.item()) if isinstance(v, torch.Tensor) else float(v), s)
                          for n, v, s in batch]
                for b in self.backends:
                    b.write(events)
            except BaseException as exc:  # raised on the step's thread at the next step
                self.error = exc
            finally:
                self.queue.task_done()

    def _raise_pending(self) -> None:
        if self.error is not None:
            exc, self.error = self.error, None
            self.active = False
            raise RuntimeError(f"strata: a monitor could not write its events: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Writes what was recorded since the last write, stops the thread, closes the
        backends; raises a write's error."""
        if self.thread is None:
            return
        thread, self.thread = self.thread, None
        if self.pending and self.error is None:
            self.queue.put(self.pending)
        self.pending = []
        self.queue.put(None)
        thread.join()
        for b in self.backends:
            try:
                b.close()
            except BaseException as exc:
                self.error = self.error or exc
        self._raise_pending()

    @staticmethod
    def _at_exit(ref) -> None:
        m = ref()
        if m is not None and m.thread is not None:
            try:
                m.close()
            except BaseException as exc:  # noqa: BLE001  (at exit: say it, nothing to raise to)
                import logging

                logging.getLogger("strata").error("%s", exc)
