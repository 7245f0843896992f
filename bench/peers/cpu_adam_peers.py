"""CPU-Adam beside DeepSpeed's, in one process, on the same buffers.

Two comparisons, each interleaved round by round (A, B, A, B, ...) so a shared machine's
drift hits both alike; each reports the median seconds per step:

  fp32   DeepSpeedCPUAdam.step() against Strata's fused fp32 step, on the same n fp32
         parameters and gradients (each with its own m and v), the same thread count.
  mixed  DeepSpeed ZeRO's sequence for bf16 gradients on an offloaded optimizer, emulated
         with the torch ops its stage-3 optimizer uses: copy the bf16 gradients to the
         fp32 partition, norm and inf/NaN check, unscale and clip in place,
         DeepSpeedCPUAdam.step(), copy the fp32 parameters back to bf16; against Strata's
         norm pass plus one fused step with unscale, clip and the bf16 copy-out.

Both run AdamW (weight decay 0.01). The bytes each path moves per parameter are counted
(28 B for one fp32 Adam pass) and GB/s printed beside the times.

usage: .venv/bin/python bench/peers/cpu_adam_peers.py [--size N] [--threads T] [--reps R]
(needs bench/peers/install.sh; DeepSpeed builds its CPU-Adam op on first use)
"""

import argparse
import os
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=64 << 20, help="parameters (default 64M)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both (default: all)")
    ap.add_argument("--reps", type=int, default=9, help="timed rounds after one warm-up (default 9)")
    args = ap.parse_args()
    # OpenMP (DeepSpeed's op) and torch's intra-op pool read these before they start.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    # OpenMP workers (DeepSpeed's op, torch's pool) otherwise spin after each parallel
    # region and take the cores from the next path's threads: measured on the 2-core dev
    # VM, both paths ran about 1.7x slower interleaved with the default policy.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    torch.set_num_threads(args.threads)
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError as e:
        sys.exit(f"cpu_adam_peers: DeepSpeed is not installed ({e}); run bench/peers/install.sh")
    from strata import _strata

    n, lr, wd = args.size, 1e-3, 0.01
    gen = torch.Generator().manual_seed(0)
    p_ds = torch.rand(n, generator=gen) - 0.5
    p_st = p_ds.clone()
    g32 = (torch.rand(n, generator=gen) - 0.5) * 1e-2
    g16 = (g32 * 1024).to(torch.bfloat16)  # loss-scaled bf16 gradients
    p16_ds = torch.empty(n, dtype=torch.bfloat16)
    p16_st = torch.empty(n, dtype=torch.bfloat16)
    m_st, v_st = torch.zeros(n), torch.zeros(n)

    param = torch.nn.Parameter(p_ds)
    ds = DeepSpeedCPUAdam([param], lr=lr, weight_decay=wd, adamw_mode=True)
    kernel = _strata.AdamKernel(args.threads)
    step_st = [0]

    def strata_fp32():
        step_st[0] += 1
        kernel.step(p_st.data_ptr(), g32.data_ptr(), m_st.data_ptr(), v_st.data_ptr(), n, "fp32",
                    step_st[0], lr, 0.9, 0.999, 1e-8, wd, True, True)

    def ds_fp32():
        param.grad = g32
        ds.step()

    grad_fp32_partition = torch.empty(n)

    def ds_mixed():
        # DeepSpeed ZeRO-3 offload, bf16: the reduced bf16 gradients are copied into the
        # fp32 partition's grad, the norm is taken (and checked for inf/NaN), the gradient
        # is unscaled and clipped in place, CPU-Adam steps, and the fp32 parameters are
        # copied back into the bf16 partition.
        grad_fp32_partition.copy_(g16)
        norm = torch.linalg.vector_norm(grad_fp32_partition).item() / 1024
        if not torch.isfinite(torch.tensor(norm)):
            sys.exit("cpu_adam_peers: overflow in the DeepSpeed path")
        clip = min(1.0, 1.0 / (norm + 1e-6))
        grad_fp32_partition.mul_(clip / 1024)
        param.grad = grad_fp32_partition
        ds.step()
        p16_ds.copy_(param.data)

    def strata_mixed():
        sum_sq, bad = kernel.grad_squared_norm(g16.data_ptr(), n, "bf16", 1.0 / 1024)
        if bad:
            sys.exit("cpu_adam_peers: overflow in the Strata path")
        clip = min(1.0, 1.0 / (sum_sq**0.5 + 1e-6))
        step_st[0] += 1
        kernel.step(p_st.data_ptr(), g16.data_ptr(), m_st.data_ptr(), v_st.data_ptr(), n, "bf16",
                    step_st[0], lr, 0.9, 0.999, 1e-8, wd, True, True,
                    inv_loss_scale=1.0 / 1024, clip_coef=clip, param16=p16_st.data_ptr(),
                    param16_dtype="bf16")

    def timed(fns):
        for f in fns:  # warm-up (DeepSpeed's first step allocates its state)
            f()
        times = [[] for _ in fns]
        for _ in range(args.reps):
            for k, f in enumerate(fns):
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        return [statistics.median(t) for t in times]

    print(f"cpu_adam_peers: {n} parameters, {args.threads} threads, {args.reps} rounds, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; "
          f"deepspeed {deepspeed.__version__} (accelerator {os.environ['DS_ACCELERATOR']}), "
          f"torch {torch.__version__}, Strata kernel {kernel.isa}")
    print(f"{'path':<34} {'B/param':>7} {'ms/step':>9} {'Mparams/s':>10} {'GB/s':>7}")
    rows = []
    t_ds, t_st = timed([ds_fp32, strata_fp32])
    rows += [("fp32: DeepSpeedCPUAdam", 28, t_ds), ("fp32: Strata", 28, t_st)]
    fp32_speedup = t_ds / t_st
    t_ds, t_st = timed([ds_mixed, strata_mixed])
    # DeepSpeed: copy 2+4, norm 4, clip 8, Adam 28, copy back 4+2; Strata: norm 2, step 2+12+12+2.
    rows += [("mixed bf16: DeepSpeed ZeRO path", 52, t_ds), ("mixed bf16: Strata fused", 30, t_st)]
    mixed_speedup = t_ds / t_st
    for name, b, t in rows:
        print(f"{name:<34} {b:>7} {t * 1e3:>9.1f} {n / t / 1e6:>10.1f} {b * n / t / 1e9:>7.2f}")
    print(f"Strata / DeepSpeed: fp32 {fp32_speedup:.2f}x, mixed {mixed_speedup:.2f}x")


if __name__ == "__main__":
    main()
