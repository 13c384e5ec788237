"""Summarise a `serve --trace-rounds` file: per server start, phases split at idle gaps > 0.3 s; per phase
(max batch >= 8) rounds, time, speculative rounds (at load >= 16 and their gammas), the draft's reads.

    python experiments/trace_phases.py runs/c16-trace.jsonl
"""
import json, sys
from collections import Counter
runs=[];cur=None
for line in open(sys.argv[1]):
    d=json.loads(line)
    if 'start' in d: cur=[];runs.append(cur);continue
    cur.append(d)
for i,r in enumerate(runs):
    if not r: continue
    phases=[[r[0]]]
    for a,b in zip(r,r[1:]):
        if b['t']-a['t']>0.3: phases.append([])
        phases[-1].append(b)
    for p in phases:
        top=max(x['batch'] for x in p)
        if top<8: continue
        tot=sum(x['seconds']+x.get('read_s',0) for x in p)
        spec=[x for x in p if x['gamma']]
        reads=sum(x.get('read_s',0) for x in p)
        big=[x for x in spec if x['load']>=16]
        print(f"run {i} phase max {top}: rounds {len(p)} time {tot:.2f}s spec rounds {len(spec)} "
              f"(load>=16: {len(big)}, {sum(x['seconds'] for x in big):.3f}s) reads {reads:.3f}s "
              f"gammas@16 {dict(Counter(x['gamma'] for x in big))}")
