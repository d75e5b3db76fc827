#!/usr/bin/env python3
"""Seed 001 and 004 tables of docs/benchmarks.md from run_json.py output:
issue7_tables.py 001|004 RUNS.jsonl (tags: [threads, mode, run])."""
import json, sys, statistics as st
def load(path):
    rows=[json.loads(l) for l in open(path)]
    return rows
def seed001(path):
    rows=load(path)
    by={}
    lru={}
    for r in rows:
        t,mode,run=r['tag']; rep=r['report']
        if 'error' in rep: print('ERR',r['tag'],rep['error'][-300:]); continue
        by.setdefault((t,mode),[]).append(rep['faults_per_s'])
        if rep.get('uswap') and rep['uswap'].get('lockstat'):
            for c in rep['uswap']['lockstat']:
                if c['name']=='lru':
                    d=lru.setdefault((t,mode),[0,0,0,0])
                    d[0]+=c['acquisitions']; d[1]+=c['contended']; d[2]+=c['wait_ns_total']; d[3]=max(d[3],c['wait_ns_max'])
    modes=['mutex','spin','rwlock','kernel']
    print('| threads | '+' | '.join(f'{m} faults/s (mean ± sd)' for m in modes)+' | rwlock/mutex |')
    print('|---|'+'---|'*(len(modes)+1))
    for t in [1,2,4,8]:
        cells=[]
        for m in modes:
            v=by.get((t,m),[])
            cells.append(f"{st.mean(v):,.0f} ± {st.stdev(v) if len(v)>1 else 0:,.0f}" if v else '-')
        ratio=st.mean(by[(t,'rwlock')])/st.mean(by[(t,'mutex')]) if by.get((t,'rwlock')) and by.get((t,'mutex')) else float('nan')
        print(f'| {t} | '+' | '.join(cells)+f' | {ratio:.2f} |')
    print()
    print('| threads | mode | LRU acquisitions | contended | % | wait total (ms) | wait max (µs) |')
    print('|---|---|---|---|---|---|---|')
    for t in [1,2,4,8]:
        for m in modes[:3]:
            if (t,m) in lru:
                a,c,w,mx=lru[(t,m)]
                print(f'| {t} | {m} | {a:,} | {c:,} | {100*c/max(a,1):.2f} | {w/1e6:.1f} | {mx/1e3:.1f} |')
def seed004(path):
    rows=load(path); by={}
    for r in rows:
        t,p,run=r['tag']; rep=r['report']
        if 'error' in rep: print('ERR',r['tag']); continue
        by.setdefault((t,p),[]).append(rep['faults_per_s'])
    print('| threads | pcp on: hmean | sd | cv | pcp off: hmean | sd | cv | on/off |')
    print('|---|---|---|---|---|---|---|---|')
    for t in [1,2,4,8]:
        on,off=by.get((t,'on'),[]),by.get((t,'off'),[])
        if not on or not off: continue
        h=lambda v: st.harmonic_mean(v)
        print(f'| {t} | {h(on):,.0f} | {st.stdev(on):,.0f} | {st.stdev(on)/st.mean(on):.3f} | {h(off):,.0f} | {st.stdev(off):,.0f} | {st.stdev(off)/st.mean(off):.3f} | {h(on)/h(off):.2f} |')
if __name__=='__main__':
    {'001':seed001,'004':seed004}[sys.argv[1]](sys.argv[2])
