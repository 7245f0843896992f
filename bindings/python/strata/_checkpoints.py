"""The engine's checkpoints from Python: what is Python's own beside what the engine saves
(engine/libtorch/tensor_engine.h keeps the states, the whole tensors and torch's generators):
Python's ``random`` and NumPy's generators, and the client state as ``torch.save`` bytes."""

from __future__ import annotations

import io
import json
import logging
import os
import random
import sys
from typing import Any, Dict, List, Mapping, Optional, Union

import torch

from . import _strata

# Checkpoint blob names, the same for both front ends (engine/checkpoint/blobs.h).
_BLOB = _strata.BLOB_NAMES
# Python's own: a client lr_scheduler's state_dict (strata/_client.py), torch.save bytes.
_CLIENT_SCHEDULER = "lr_scheduler:client"


def _python_rng_blobs() -> List[tuple]:
    """Python's and (when imported) NumPy's generators, as checkpoint blobs."""
    version, state, gauss = random.getstate()
    out = [(_BLOB["python_rng"], json.dumps([version, list(state), gauss]).encode())]
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out.append((_BLOB["numpy_rng"], json.dumps([name, keys.tolist(), pos, has_gauss, cached]).encode()))
    return out


def _set_python_rng(blobs: Dict[str, bytes]) -> None:
    if _BLOB["python_rng"] in blobs:
        version, st, gauss = json.loads(blobs[_BLOB["python_rng"]])
        random.setstate((version, tuple(st), gauss))
    np = sys.modules.get("numpy")
    if np is not None and _BLOB["numpy_rng"] in blobs:
        name, keys, pos, has_gauss, cached = json.loads(blobs[_BLOB["numpy_rng"]])
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _read_torch_blob(data: bytes, what: str, path: str):
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001: the reason is passed on
        raise RuntimeError(
            f"strata: engine.load_checkpoint: the {what} in {path} cannot be read with "
            f"torch.load(weights_only=True): {exc}"
        ) from exc


class CheckpointMixin:
    """``save_checkpoint`` and ``load_checkpoint`` of strata.engine.Engine."""

    def save_checkpoint(self, save_dir: Union[str, os.PathLike], tag: Optional[str] = None,
                        client_state: Optional[Mapping[str, Any]] = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> str:
        """Collective: saves a checkpoint into ``save_dir/tag`` (tag None:
        ``global_step<N>``) and moves ``save_dir/latest`` to it; returns the tag's directory.
        Call it before training or right after ``step()``.

        It holds each rank's fp32 master parameters (its shards of the frozen ones too),
        Adam m and v, the step counts, loss scaler and schedule position; the parameters
        left out of ``model_parameters`` (rank 0's) and each rank's buffers; each rank's RNG
        states (torch's CPU generator, the CUDA device's, Python's ``random`` and, when
        imported, NumPy's); and ``client_state`` (this rank's; anything
        ``torch.load(weights_only=True)`` reads back: tensors, numbers, strings, lists,
        dicts). Atomic: a failed or killed save leaves the previous checkpoints and
        ``latest`` as they were (docs/checkpoints.md).

        ``exclude_frozen_parameters`` (DeepSpeed's name): leave the frozen parameters'
        values out (those the engine partitioned with requires_grad False: a LoRA run's
        base), so the checkpoint holds what trains, with a fingerprint of each frozen group.
        A load then keeps the frozen values the model has, and refuses them when they are not
        that base: build the model with the same base weights first."""
        if not save_latest:
            raise ValueError(
                "strata: engine.save_checkpoint(save_latest=False) is not supported: `latest` "
                "always names the last complete save"
            )
        buf = io.BytesIO()
        torch.save(dict(client_state or {}), buf)
        blobs = _python_rng_blobs() + [(_BLOB["client_state"], buf.getvalue())]
        if self._client_schedule is not None:
            sched = io.BytesIO()
            torch.save(self._client_schedule.state_dict(), sched)
            blobs.append((_CLIENT_SCHEDULER, sched.getvalue()))
        return self._core.save_checkpoint(self._mp_dir(save_dir), tag or "", blobs, self._whole_tensors(),
                                          bool(exclude_frozen_parameters))

    def _mp_dir(self, d: Union[str, os.PathLike]) -> str:
        """Under model parallelism each model-parallel rank's data-parallel group keeps its
        checkpoints in its own subdirectory ``mp_rank_NN`` (its shards are its own model)."""
        d = os.fspath(d)
        return os.path.join(d, f"mp_rank_{self._mp_rank:02d}") if self._mp_world > 1 else d

    def load_checkpoint(self, load_dir: Union[str, os.PathLike], tag: Optional[str] = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Any = None, *, missing_ok: bool = True,
                        check_frozen_parameters: bool = True) -> tuple:
        """Collective: loads ``load_dir/tag`` (tag None: the one ``load_dir/latest`` names),
        saved on any number of ranks; returns ``(path, client_state)`` as DeepSpeed's does.

        Every rank first checks the manifest against the model (the missing, extra and
        mismatched names listed), the frozen parameters and buffers, and the CRC32C of
        everything it reads; a failure on any rank raises on every rank with nothing
        changed. ``load_optimizer_states=False``: a fresh optimizer (m = v = 0, step 0).
        ``load_lr_scheduler_states=False``: the schedule keeps its position.
        ``load_module_only``: the parameters and buffers only. When ``load_dir`` holds no
        checkpoint at all (no ``latest``) and no tag is given, rank 0 logs a warning and it
        returns ``(None, None)``, as DeepSpeed's does (auto-resume); ``missing_ok=False``
        raises FileNotFoundError instead.

        A checkpoint saved with ``exclude_frozen_parameters`` keeps the model's frozen values
        and checks them against its fingerprint of the saving run's base first: another base
        raises ValueError naming the groups, with nothing changed.
        ``check_frozen_parameters=False`` (the same on every rank) loads it onto this base
        anyway.

        DeepSpeed's positional order (``load_module_strict`` third): the load is always
        strict (every name and shape must match), so ``load_module_strict=False`` and a
        ``custom_load_fn`` are refused rather than ignored."""
        if not load_module_strict:
            raise ValueError(
                "strata: engine.load_checkpoint(load_module_strict=False) is not supported: a Strata "
                "checkpoint loads only onto the model it was saved from (every name and shape checked)"
            )
        if custom_load_fn is not None:
            raise NotImplementedError("strata: engine.load_checkpoint(custom_load_fn=...) is not supported")
        load_dir = self._mp_dir(load_dir)
        if missing_ok and tag is None and not os.path.exists(os.path.join(load_dir, "latest")):
            # The same answer on every rank when load_dir is shared, as it must be.
            if self._core.rank == 0:
                logging.getLogger("strata").warning(
                    "strata: engine.load_checkpoint(%s): no 'latest' file there, so no checkpoint to load; "
                    "nothing was changed (pass a tag to load one by name, or missing_ok=False to raise)", load_dir)
            return None, None
        loaded = self._core.load_checkpoint(load_dir, tag or "", load_optimizer_states, load_lr_scheduler_states,
                                            load_module_only, bool(check_frozen_parameters), self._whole_tensors())
        blobs = loaded["blobs"]
        if not load_module_only:
            self._global_steps = int(loaded["global_steps"])  # steps_per_print counts on from there
            _set_python_rng(blobs)
            if load_lr_scheduler_states and self._client_schedule is not None and _CLIENT_SCHEDULER in blobs:
                self._client_schedule.load_state_dict(_read_torch_blob(blobs[_CLIENT_SCHEDULER], "lr_scheduler",
                                                                       loaded["path"]))
        client_state = None
        if _BLOB["client_state"] in blobs:
            client_state = _read_torch_blob(blobs[_BLOB["client_state"]], "client_state", loaded["path"])
        self._needs_load = False
        return loaded["path"], client_state
