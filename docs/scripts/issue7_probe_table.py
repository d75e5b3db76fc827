#!/usr/bin/env python3
"""Seed 003 probe tables of docs/benchmarks.md from run_json.py output (tags: [device, config, run])."""
import json,sys,statistics as st
rows=[json.loads(l) for l in open(sys.argv[1])]
by={}
for r in rows:
    dev,cfg,run=r['tag']; rep=r['report']
    if 'error' in rep:
        print('ERR',r['tag'],rep['error'][-200:].replace('\n',' ')); continue
    rtt=rep['rtt']
    by.setdefault((dev,cfg),[]).append((rtt,rep.get('accesses_per_s') or rep.get('writes_per_s'), rep))
print('| device | backend | run | probes | min/avg/max/mdev (µs) | p50 | p99 | p99.9 | thrasher writes/s |')
print('|---|---|---|---|---|---|---|---|---|')
for (dev,cfg),v in sorted(by.items()):
    for i,(r,a,rep) in enumerate(v):
        print(f"| {dev} | {cfg} | {i+1} | {r['probes']:,} | {r['min_us']:.2f}/{r['avg_us']:.2f}/{r['max_us']:.0f}/{r['mdev_us']:.2f} | {r['p50_us']:.2f} | {r['p99_us']:.2f} | {r['p999_us']:.1f} | {a:,.0f} |")
print()
print('| device | backend | median p99.9 (µs) | median max (µs) | median writes/s |')
print('|---|---|---|---|---|')
for (dev,cfg),v in sorted(by.items()):
    print(f"| {dev} | {cfg} | {st.median([r['p999_us'] for r,a,_ in v]):.1f} | {st.median([r['max_us'] for r,a,_ in v]):.0f} | {st.median([a for r,a,_ in v]):,.0f} |")
