#!/usr/bin/env python3
"""One decode step's kernels as a table (issue 23, item 1).

Input: an `ncu --csv --print-units base` file with the metrics gpu__time_duration.sum (ns),
dram__bytes_read.sum and dram__bytes_write.sum (bytes) over several decode steps, the step's
measured time in microseconds (from `bench model`'s tg tok/s: 1e6 / tok/s, graph replay) and
the layer count. A step is cut at the router kernel of layer 0: from one occurrence of the
router kernel whose index is a multiple of n_layer to the next (the same kernels as the step
from its embedding on, rotated; the router is router_route_kernel, else moe_route_kernel). A
model without routers (dense) is cut at its whole-row norms instead, 2 n_layer + 1 per step
(each layer's two, then the output norm). The second-to-last complete window is reported (the
last may be cut by the end of the run).

Output (markdown): per kernel name, in order of total time: launches, time (us), share, DRAM
bytes read + written (MB), achieved GB/s; then the sums, the measured step, and the gap between
them (ncu runs kernels one at a time, without programmatic dependent launch or graph replay,
so the sum is the step's kernel time in isolation; measured step minus sum is the time the
replayed step spends outside kernels; negative when overlap hides some of it).
"""
import collections
import csv
import re
import sys


def main():
    if len(sys.argv) < 4:
        sys.exit("usage: decode_step_table.py NCU_CSV STEP_US N_LAYER [HBM_GBPS]")
    path, step_us, n_layer = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    hbm = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    kernels = collections.OrderedDict()  # ID -> [name, ns, read, write]
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = None
    for r in rows:
        if "Kernel Name" in r and "Metric Name" in r:
            head = {k: i for i, k in enumerate(r)}
            continue
        if head is None or len(r) < len(head):
            continue
        try:
            v = float(r[head["Metric Value"]].replace(",", ""))
        except ValueError:
            continue
        k = kernels.setdefault(r[head["ID"]], [r[head["Kernel Name"]], 0.0, 0.0, 0.0])
        m = r[head["Metric Name"]]
        if m == "gpu__time_duration.sum":
            k[1] = v
        elif m == "dram__bytes_read.sum":
            k[2] = v
        elif m == "dram__bytes_write.sum":
            k[3] = v
    seq = list(kernels.values())
    def short(n):  # the kernel's own name (berth's kernels end in _kernel), else the whole
        m = re.search(r"([A-Za-z_]\w*_kernel)\b", n)
        return m.group(1) if m else n[:60]
    # One router kernel per layer: the fused decode one, else moe_route_kernel.
    routers = [i for i, k in enumerate(seq) if short(k[0]) == "router_route_kernel"]
    if len(routers) < 3 * n_layer:
        routers = [i for i, k in enumerate(seq) if short(k[0]) == "moe_route_kernel"]
    per_step = n_layer
    if not routers:  # dense: two whole-row norms per layer and the output norm
        routers = [i for i, k in enumerate(seq) if short(k[0]) == "rms_norm_kernel"]
        per_step = 2 * n_layer + 1
    starts = routers[::per_step]
    if len(starts) < 3:
        sys.exit(f"decode_step_table: {len(routers)} router (or norm) kernels, fewer than 3 "
                 f"steps of {n_layer} layers")
    step = seq[starts[-3]:starts[-2]]
    agg = collections.OrderedDict()
    for name, ns, rd, wr in step:
        a = agg.setdefault(short(name), [0, 0.0, 0.0])
        a[0] += 1
        a[1] += ns / 1e3
        a[2] += rd + wr
    tot_us = sum(a[1] for a in agg.values())
    tot_b = sum(a[2] for a in agg.values())
    print("| kernel | launches | time (us) | share | DRAM MB | GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (n, us, b) in sorted(agg.items(), key=lambda x: -x[1][1]):
        print(f"| {name} | {n} | {us:.1f} | {100 * us / tot_us:.1f}% | {b / 1e6:.1f} | "
              f"{b / us / 1e3 if us > 0 else 0:.0f} |")
    print(f"| **sum of kernels** | {sum(a[0] for a in agg.values())} | {tot_us:.1f} | 100% | "
          f"{tot_b / 1e6:.1f} | {tot_b / tot_us / 1e3:.0f} |")
    print()
    print(f"Measured step (graph replay, from tg): {step_us:.1f} us; kernels alone {tot_us:.1f} us; "
          f"outside kernels {step_us - tot_us:.1f} us ({100 * (step_us - tot_us) / step_us:.1f}%).")
    if hbm > 0:
        bound = tot_b / (hbm * 1e3)
        print(f"HBM bound of the step's DRAM bytes ({tot_b / 1e9:.3f} GB at {hbm:.0f} GB/s): "
              f"{bound:.1f} us; the step reaches {100 * bound / step_us:.1f}% of it "
              f"({1e6 / bound:.0f} tok/s at the bound).")


if __name__ == "__main__":
    main()
