#!/usr/bin/env python3
"""Miss ratios of LRU designs on `uswap bench random`'s access patterns: replacement policy
alone, without timing, so designs can be compared without the machine's noise.

The trace is what the benchmark does: every page written once in order (the setup), then
ACCESSES draws from the distribution (ranks scattered over the pages by a fixed
permutation). Misses are counted after the first quarter of the draws.

Models (one eviction per miss once memory is full):
  kernel    the kernel's anonymous LRU without MGLRU: new pages and distant refaults join
            the inactive list, refaults within the working set the active list; a page
            referenced while inactive (accessed bit) is activated at the inactive tail,
            else evicted; the active tail is deactivated, references cleared, while the
            inactive list is under a third of the active one (inactive_ratio 3, 1 GiB).
  two-list  uswap's `--lru-policy two-list`: every page mapped joins the active head; aging
            unmaps the active tail into the inactive window (10% of memory), where a touch
            (a minor fault) promotes a page to the active head with its referenced bit
            (one more trip round); a page not touched is evicted.
  s3fifo    uswap's `--lru-policy s3fifo`: new pages and distant refaults join probation,
            which aging unmaps first; refaults within the working set and pages touched in
            the window join the active list.
  s3fifo-share  as s3fifo, but probation is aged first only while it holds more than a tenth
            of the mapped pages (S3-FIFO's small-queue share), the first design tried.

  python3 docs/scripts/lru_sim.py zipf:0.99 4000000
  python3 docs/scripts/lru_sim.py hot:90/10 4000000
"""

import bisect
import random
import sys
from collections import OrderedDict

PAGES = 1 << 19  # 2 GiB of 4 KiB pages
MEMORY = 1 << 18  # 1 GiB
WINDOW = MEMORY // 10  # uswap's inactive list: Config::inactive_percent 10


def trace(distribution, accesses, seed=1):
    rng = random.Random(seed)
    perm = list(range(PAGES))
    rng.shuffle(perm)
    if distribution.startswith("zipf:"):
        s = float(distribution.split(":")[1])
        cum, total = [], 0.0
        for rank in range(PAGES):
            total += 1.0 / (rank + 1) ** s
            cum.append(total)
        draw = lambda: perm[bisect.bisect_left(cum, rng.random() * total)]
    elif distribution.startswith("hot:"):
        p, q = distribution.split(":")[1].split("/")
        share, hot = int(p) / 100, PAGES * int(q) // 100
        draw = lambda: (perm[rng.randrange(hot)] if rng.random() < share
                        else perm[hot + rng.randrange(PAGES - hot)])
    else:
        draw = lambda: rng.randrange(PAGES)
    return list(range(PAGES)) + [draw() for _ in range(accesses)]


def kernel(pages, counted_from):
    active, inactive = OrderedDict(), OrderedDict()  # the last entry is the head
    referenced, shadow = {}, {}
    age = misses = 0
    for i, p in enumerate(pages):
        if p in active or p in inactive:
            referenced[p] = True
            continue
        misses += i >= counted_from
        near = p in shadow and age - shadow.pop(p) <= len(active)
        if near:
            active[p] = None
            age += 1
        else:
            inactive[p] = None
        referenced[p] = False
        while len(active) + len(inactive) > MEMORY:
            while len(inactive) * 3 < len(active):
                q, _ = active.popitem(last=False)
                inactive[q], referenced[q] = None, False
            q, _ = inactive.popitem(last=False)
            age += 1
            if referenced[q]:
                active[q], referenced[q] = None, False
            else:
                shadow[q] = age
                del referenced[q]
    return misses, 0


def uswap(pages, counted_from, policy):
    active, probation, window = OrderedDict(), OrderedDict(), OrderedDict()
    referenced, shadow = set(), {}
    age = misses = minors = 0
    for i, p in enumerate(pages):
        if p in active or p in probation:
            continue
        if p in window:  # a minor fault: promoted, referenced
            del window[p]
            active[p] = None
            referenced.add(p)
            age += 1
            minors += i >= counted_from
            continue
        misses += i >= counted_from
        near = p in shadow and age - shadow.pop(p) <= len(active) + len(probation)
        if policy == "two-list" or near:
            active[p] = None
        else:
            probation[p] = None
        while len(active) + len(probation) + len(window) > MEMORY:
            while len(window) < WINDOW:
                share = (len(active) + len(probation)) // 10 if policy == "s3fifo-share" else 0
                source = probation if len(probation) > share else active
                q, _ = source.popitem(last=False)
                if q in referenced:  # second chance: one more trip, still mapped
                    referenced.discard(q)
                    active[q] = None
                else:
                    window[q] = None
            q, _ = window.popitem(last=False)
            age += 1
            shadow[q] = age
    return misses, minors


def main():
    distribution = sys.argv[1] if len(sys.argv) > 1 else "zipf:0.99"
    accesses = int(sys.argv[2]) if len(sys.argv) > 2 else 4_000_000
    pages = trace(distribution, accesses)
    counted_from = PAGES + accesses // 4
    counted = len(pages) - counted_from
    base, _ = kernel(pages, counted_from)
    print(f"{distribution}, {accesses} accesses: kernel misses {base / counted:.4f} per access")
    for policy in ["two-list", "s3fifo", "s3fifo-share"]:
        misses, minors = uswap(pages, counted_from, policy)
        print(f"{policy:13} misses {misses / counted:.4f} ({misses / base:.3f}x the kernel's),"
              f" minor faults {minors / counted:.4f}", flush=True)


if __name__ == "__main__":
    main()
