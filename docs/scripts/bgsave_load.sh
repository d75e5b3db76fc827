#!/usr/bin/env bash
# bgsave_load.sh KEYS PORT DIR [text|random]: redis-server filled with KEYS values of 1,000
# bytes (keys key:%012d, the names redis-benchmark -r uses; each value made from its key:
# its number repeated, which compresses well, or with `random`, base64 of 750 pseudo-random
# bytes seeded by the number, which compresses poorly), then BGSAVE
# while redis-benchmark sends random GETs. Prints the fork's time, the save's duration, the
# GETs' rate during the save, what the disk wrote during the save besides the dump (swap),
# and what a plain redis-server finds in the dump: its keys, and 2,000 values checked.
# Run it under `uswap run` or `uswap run --backend kernel` with the same --memory.
set -euo pipefail
KEYS=$1; PORT=$2; DIR=$3; export VALUES=${4:-text}
# The value of key number k, for the fill and the check.
VALUE='
import base64, os, random
def value(k):
    if os.environ["VALUES"] == "random":
        return base64.b64encode(random.Random(k).randbytes(750)).decode()
    return ((f"v{k}-") * 200)[:1000]
'

SOURCE=$(df --output=source "$DIR" | tail -1)
# The disk under DIR's file system: a partition's parent, or the device itself.
DISK=$(lsblk -no pkname "$SOURCE" 2>/dev/null || true)
DISK=${DISK:-$(basename "$SOURCE")}
sectors() { awk -v d="$DISK" '$3 == d {print $10}' /proc/diskstats; }
rm -f "$DIR/dump.rdb"
redis-server --save "" --appendonly no --port "$PORT" --bind 127.0.0.1 --dir "$DIR" >/dev/null &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
python3 -c "$VALUE
import sys
out = sys.stdout.buffer
for k in range(int(sys.argv[1])):
    key = b'key:%012d' % k
    val = value(k).encode()
    out.write(b'*3\r\n\$3\r\nSET\r\n\$%d\r\n%s\r\n\$%d\r\n%s\r\n' % (len(key), key, len(val), val))
" "$KEYS" | redis-cli -p "$PORT" --pipe >/dev/null
before=$(redis-cli -p "$PORT" lastsave)
sleep 1.1
written=$(sectors)
start=$(date +%s.%N)
redis-cli -p "$PORT" bgsave >/dev/null
gets=$(redis-benchmark -p "$PORT" -t get -n 200000 -r "$KEYS" -c 8 -q 2>/dev/null | tr '\r' '\n' | awk '/GET/ {print $2}' | tail -1)
while [ "$(redis-cli -p "$PORT" lastsave)" = "$before" ]; do sleep 0.1; done
save_s=$(python3 -c "import time; print(round(time.time() - $start, 1))")
# The dump's writes reach the disk, so what the disk wrote besides them is swap.
sync -f "$DIR"
swap_mib=$(( ($(sectors) - written) / 2048 - $(stat -c %s "$DIR/dump.rdb") / 1048576 ))
fork=$(redis-cli -p "$PORT" info stats | tr -d '\r' | awk -F: '/latest_fork_usec/ {print $2}')
status=$(redis-cli -p "$PORT" info persistence | tr -d '\r' | awk -F: '/rdb_last_bgsave_status/ {print $2}')
redis-cli -p "$PORT" shutdown nosave >/dev/null 2>&1 || true
wait $server 2>/dev/null || true
redis-server --port $((PORT + 1)) --bind 127.0.0.1 --dir "$DIR" --save "" >/dev/null &
check=$!
for _ in $(seq 600); do [ "$(redis-cli -p $((PORT + 1)) ping 2>/dev/null)" = PONG ] && break; sleep 0.1; done
keys=$(redis-cli -p $((PORT + 1)) dbsize)
bad=$(python3 -c "$VALUE
import subprocess, sys
keys, port = int(sys.argv[1]), sys.argv[2]
sample = random.Random(7).sample(range(keys), 2000)
cmds = ''.join('GET key:%012d\n' % k for k in sample)
out = subprocess.run(['redis-cli', '-p', port], input=cmds, capture_output=True, text=True).stdout.split('\n')
print(sum(got != value(k) for k, got in zip(sample, out)))
" "$KEYS" $((PORT + 1)))
redis-cli -p $((PORT + 1)) shutdown nosave >/dev/null 2>&1 || true
wait $check 2>/dev/null || true
echo "fork_usec $fork save_s $save_s get_rps $gets swap_written_mib $swap_mib status $status dump_keys $keys bad_values $bad"
