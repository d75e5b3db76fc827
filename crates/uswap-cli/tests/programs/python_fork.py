"""fork without exec from Python: a multiprocessing pool (the fork start method) whose
workers read the parent's data, several times the memory limit, and check it; and
os.fork() children that change their copy, which the parent must not see.

usage: python_fork.py SIZE_MB; prints "ok <workers> workers <bytes> bytes" or exits 1.
"""
import hashlib
import multiprocessing as mp
import os
import sys

CHUNK = 1 << 20
DATA = []


def block(i, version=0):
    seed = hashlib.sha256(b"%d:%d" % (i, version)).digest()
    return seed * (CHUNK // len(seed))


def digest_of(indices):
    h = hashlib.sha256()
    for i in indices:
        if DATA[i] != block(i):
            return "mismatch %d" % i
        h.update(DATA[i][:64])
    return h.hexdigest()


def main():
    size_mb = int(sys.argv[1])
    DATA.extend(block(i) for i in range(size_mb))
    workers = 3
    ranges = [list(range(w, size_mb, workers)) for w in range(workers)]
    with mp.get_context("fork").Pool(workers) as pool:
        results = pool.map(digest_of, ranges)
    expected = [digest_of(r) for r in ranges]
    if results != expected:
        print("pool workers saw other data:", results[:1], expected[:1])
        sys.exit(1)
    for n in range(2):
        pid = os.fork()
        if pid == 0:
            ok = all(DATA[i] == block(i) for i in range(size_mb))
            for i in range(size_mb):
                DATA[i] = block(i, n + 1)
            ok = ok and all(DATA[i] == block(i, n + 1) for i in range(size_mb))
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            print("child %d failed: status %#x" % (n, status))
            sys.exit(1)
    if any(DATA[i] != block(i) for i in range(size_mb)):
        print("the parent's data changed")
        sys.exit(1)
    print("ok %d workers %d bytes" % (workers, size_mb * CHUNK))


if __name__ == "__main__":
    main()
