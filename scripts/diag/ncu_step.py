"""One decode step by kernel name: (ncu csv of a run with more steps) minus (one with fewer),
divided by the step difference. usage: ncu_step.py FEW.csv MORE.csv STEPS"""
import collections
import csv
import sys


def load(path):
    t = collections.defaultdict(float)
    b = collections.defaultdict(float)
    n = collections.Counter()
    rows = [r for r in csv.reader(open(path)) if len(r) > 14]
    if not rows:
        return t, b, n
    head = rows[0]
    name_i = head.index("Kernel Name")
    metric_i = head.index("Metric Name")
    value_i = head.index("Metric Value")
    id_i = head.index("ID")
    seen = set()
    for r in rows[1:]:
        try:
            v = float(r[value_i].replace(",", ""))
        except ValueError:
            continue
        k = r[name_i]
        if k.startswith("void "):
            k = k[5:]
        if k.endswith(")") and "(" in k:
            k = k[: k.rfind("(")]
        k = k[:70]
        if r[metric_i] == "gpu__time_duration.sum":
            t[k] += v
            if r[id_i] not in seen:
                n[k] += 1
                seen.add(r[id_i])
        elif r[metric_i] == "dram__bytes_read.sum":
            b[k] += v
    return t, b, n


t1, b1, n1 = load(sys.argv[1])
t2, b2, n2 = load(sys.argv[2])
steps = float(sys.argv[3])
keys = set(t1) | set(t2)
rows = []
for k in keys:
    dt = (t2.get(k, 0) - t1.get(k, 0)) / steps / 1e3
    db = (b2.get(k, 0) - b1.get(k, 0)) / steps / 1e6
    dn = (n2.get(k, 0) - n1.get(k, 0)) / steps
    if dn > 0 or dt > 0.5:
        rows.append((dt, dn, db, k))
rows.sort(reverse=True)
tot = sum(r[0] for r in rows)
print(f"{'us/step':>9} {'launches':>8} {'MB read':>8} {'GB/s':>7}  kernel")
for dt, dn, db, k in rows:
    gbs = db / dt * 1e3 if dt > 0 else 0.0  # MB/us = TB/s
    print(f"{dt:9.1f} {dn:8.1f} {db:8.2f} {gbs:7.0f}  {k}")
print(f"{tot:9.1f} total")
