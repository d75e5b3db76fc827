#!/usr/bin/env bash
# redis_bench.sh: redis-server and redis-benchmark as one command, for `uswap bench run`
# (the server, the client and this shell all run under the mode being measured, as the
# processes of one cgroup do under the kernel's swap).
#
# Usage: redis_bench.sh [REQUESTS] [VALUE_BYTES] [PORT]
#   REQUESTS (default 900000) SETs of VALUE_BYTES (default 1500) random values over as many
#   random keys, then as many random GETs; prints `set N/s` and `get N/s`, then checks that
#   the server still answers and holds keys, and shuts it down. At 900,000 requests the data
#   set is about 0.9 GB, 3.5x a 256 MiB limit.
#
#   uswap bench run --memory 256M --rounds 5 -- docs/scripts/redis_bench.sh
set -euo pipefail
REQUESTS=${1:-900000}
VALUE=${2:-1500}
PORT=${3:-6411}
for tool in redis-server redis-benchmark redis-cli; do
  command -v "$tool" >/dev/null || { echo "redis_bench.sh: $tool is not installed" >&2; exit 2; }
done
redis-server --save "" --appendonly no --port "$PORT" --bind 127.0.0.1 >/dev/null &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  redis-cli -p "$PORT" ping >/dev/null 2>&1 && break
  sleep 0.1
done
rate() {
  redis-benchmark -p "$PORT" -t "$1" -n "$REQUESTS" -d "$VALUE" -r "$REQUESTS" -q 2>&1 |
    tr '\r' '\n' | awk -v t="$1" '/requests per second/ { r = $2 } END { print t, r "/s" }'
}
rate set
rate get
keys=$(redis-cli -p "$PORT" dbsize)
[ "$keys" -gt 0 ] || { echo "redis_bench.sh: the server holds no keys" >&2; exit 1; }
echo "keys $keys"
redis-cli -p "$PORT" shutdown nosave >/dev/null 2>&1 || true
wait "$server" || true
