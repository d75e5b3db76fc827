#!/usr/bin/env bash
# bgsave.sh KEYS SIZE PORT DIR: redis-server with KEYS values of SIZE bytes (DEBUG POPULATE),
# then BGSAVE, waited for until LASTSAVE moves; prints the fork's time (latest_fork_usec), the
# save status, and the keys a plain redis-server finds in the dump.
set -euo pipefail
KEYS=$1; SIZE=$2; PORT=$3; DIR=$4
rm -f "$DIR/dump.rdb"
redis-server --enable-debug-command yes --save "" --appendonly no --port "$PORT" --bind 127.0.0.1 --dir "$DIR" >/dev/null &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
redis-cli -p "$PORT" debug populate "$KEYS" key "$SIZE" >/dev/null
before=$(redis-cli -p "$PORT" lastsave)
sleep 1.1
redis-cli -p "$PORT" bgsave >/dev/null
for _ in $(seq 1200); do [ "$(redis-cli -p "$PORT" lastsave)" != "$before" ] && break; sleep 0.1; done
fork=$(redis-cli -p "$PORT" info stats | tr -d '\r' | awk -F: '/latest_fork_usec/ {print $2}')
status=$(redis-cli -p "$PORT" info persistence | tr -d '\r' | awk -F: '/rdb_last_bgsave_status/ {print $2}')
redis-cli -p "$PORT" shutdown nosave >/dev/null 2>&1 || true
wait $server 2>/dev/null || true
redis-server --port $((PORT + 1)) --bind 127.0.0.1 --dir "$DIR" --save "" >/dev/null &
check=$!
for _ in $(seq 600); do [ "$(redis-cli -p $((PORT + 1)) ping 2>/dev/null)" = PONG ] && break; sleep 0.1; done
keys=$(redis-cli -p $((PORT + 1)) dbsize)
redis-cli -p $((PORT + 1)) shutdown nosave >/dev/null 2>&1 || true
wait $check 2>/dev/null || true
echo "fork_usec $fork status $status dump_keys $keys"
