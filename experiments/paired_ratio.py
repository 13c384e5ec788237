"""Median paired ratio (per repeat) of two variants in a serving bench result.json, with a bootstrap 95%
interval: a direct A/B of two launched servers that the report only shows against the baseline.

    python experiments/paired_ratio.py DIR/result.json adaptive adaptive-before
"""
import json, random, statistics, sys
r = json.load(open(sys.argv[1])); num, den = sys.argv[2], sys.argv[3]
rows = {(x['variant'], x['load']): x for x in r['serving']['rows']}
loads = sorted({l for _, l in rows}, key=lambda l: int(l[2:]) if l[2:].isdigit() else 0)
rng = random.Random(0)
for load in loads:
    if (num, load) not in rows or (den, load) not in rows: continue
    a = {p['repeat']: p['tokens_per_s'] for p in rows[(num, load)]['per_repeat']}
    b = {p['repeat']: p['tokens_per_s'] for p in rows[(den, load)]['per_repeat']}
    ratios = [a[k] / b[k] for k in a if k in b]
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    print(f"{load}: {num}/{den} median {statistics.median(ratios):.3f} [{boots[50]:.3f}-{boots[1949]:.3f}] n={len(ratios)}")
