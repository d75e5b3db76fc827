#!/usr/bin/env python3
"""python_alloc: builds a data set of Python objects of a requested size, then checks all
of it. Run by crates/uswap-cli/tests/run_programs.rs, under `uswap run` and on its own.

    python3 python_alloc.py SIZE [SEED]

SIZE (suffix K, M or G, powers of 1024) is the approximate memory the objects take
(sys.getsizeof, so the real footprint is somewhat larger). The data set is a list of
chunks, each one of: a list of bytes objects (64 B to 64 KiB: these go to malloc), a list
of ints (small objects: pymalloc arenas, which Python maps with mmap), or a dict from str
keys to (int, bytes, float) tuples. Every chunk is generated from its own seed, and its
digest is recorded when it is built.

The check recomputes each chunk's digest from the objects in memory and compares it with
the one recorded, then rebuilds the chunk from its seed and compares the objects, so a
chunk that changed after it was built and one built wrong are both caught. It prints
`ok <chunks> chunks <bytes> bytes` and exits 0, or prints the first mismatch and exits 1.

PYTHON_ALLOC_CORRUPT=1 changes one object after the build, to show that a mismatch is
caught (the tests use it).
"""

import hashlib
import os
import random
import struct
import sys

KINDS = ("bytes", "ints", "dict")


def parse_size(text):
    units = {"": 0, "K": 10, "M": 20, "G": 30}
    t = text.upper().removesuffix("B").removesuffix("I")
    suffix = t[-1:] if t[-1:] in units else ""
    number = t[: len(t) - len(suffix)]
    if not number.isdigit() or int(number) == 0:
        raise ValueError(f"bad size {text!r}")
    return int(number) << units[suffix]


def build_chunk(seed, index):
    """The chunk with this index: the same objects for the same (seed, index)."""
    rng = random.Random(seed * 1_000_003 + index)
    kind = KINDS[rng.randrange(len(KINDS))]
    if kind == "bytes":
        return kind, [rng.randbytes(64 << rng.randrange(11)) for _ in range(rng.randrange(16, 64))]
    if kind == "ints":
        return kind, [rng.getrandbits(rng.choice((8, 30, 62, 120))) for _ in range(rng.randrange(2000, 8000))]
    d = {}
    for j in range(rng.randrange(200, 800)):
        d[f"k{index}:{j}:{rng.getrandbits(32):08x}"] = (
            rng.getrandbits(48),
            rng.randbytes(rng.randrange(8, 512)),
            rng.random(),
        )
    return kind, d


def digest(kind, obj):
    h = hashlib.blake2b(kind.encode(), digest_size=16)
    if kind == "bytes":
        for b in obj:
            h.update(struct.pack("<Q", len(b)))
            h.update(b)
    else:
        # repr is exact for ints, floats, str and bytes, and follows the dict's order.
        h.update(repr(obj).encode())
    return h.digest()


def footprint(kind, obj):
    size = sys.getsizeof(obj)
    if kind == "dict":
        for k, v in obj.items():
            size += sys.getsizeof(k) + sys.getsizeof(v) + sum(sys.getsizeof(x) for x in v)
    else:
        size += sum(sys.getsizeof(x) for x in obj)
    return size


def main(argv):
    if len(argv) not in (2, 3):
        print(f"usage: {argv[0]} SIZE [SEED]   (SIZE like 256M)", file=sys.stderr)
        return 2
    try:
        target = parse_size(argv[1])
        seed = int(argv[2]) if len(argv) == 3 else 1
    except ValueError as e:
        print(f"python_alloc: {e}", file=sys.stderr)
        return 2

    chunks = []  # (kind, object)
    digests = []
    total = 0
    while total < target:
        kind, obj = build_chunk(seed, len(chunks))
        chunks.append((kind, obj))
        digests.append(digest(kind, obj))
        total += footprint(kind, obj)

    if os.environ.get("PYTHON_ALLOC_CORRUPT") == "1":
        kind, obj = chunks[len(chunks) // 2]
        if kind == "dict":
            key = next(iter(obj))
            a, b, c = obj[key]
            obj[key] = (a ^ 1, b, c)
        else:
            obj[len(obj) // 2] = obj[len(obj) // 2] + (b"!" if kind == "bytes" else 1)

    for i, (kind, obj) in enumerate(chunks):
        got = digest(kind, obj)
        if got != digests[i]:
            print(f"mismatch chunk {i} ({kind}): digest {got.hex()}, built with {digests[i].hex()}")
            return 1
        want_kind, want = build_chunk(seed, i)
        if want_kind != kind or want != obj:
            print(f"mismatch chunk {i} ({kind}): differs from the chunk rebuilt from its seed")
            return 1

    print(f"ok {len(chunks)} chunks {total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
