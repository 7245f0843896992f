"""Run by test_huggingface.py::test_a_save_holds_a_group_not_the_model in its own process: a
model of 32 blocks of Linear(1024, 1024) (128 MiB of fp32) under strata.initialize, then
engine.save_16bit_model; prints the model's bytes, the largest group's and how much the
peak resident set grew during the save.

usage: save_memory_worker.py OUT.json SAVE_DIR
"""

import ctypes
import json
import sys

import torch

import strata

torch.set_num_threads(1)


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise AssertionError(key)


def main():
    out, save_dir = sys.argv[1], sys.argv[2]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD fixed: large blocks unmapped when freed
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(32)])
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    group_bytes = (1024 * 1024 + 1024) * 4
    cfg = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                              "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = strata.initialize(model=model, config=cfg)
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from the current resident set
    before = status("VmRSS:")
    saved = engine.save_16bit_model(save_dir)
    grown = status("VmHWM:") - before
    engine.close()
    with open(out, "w") as f:
        json.dump({"model_bytes": model_bytes, "group_bytes": group_bytes, "grown": grown,
                   "gather_bytes": saved["gather_bytes"], "file_bytes": saved["file_bytes"]}, f)


if __name__ == "__main__":
    main()
