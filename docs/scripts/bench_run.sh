#!/usr/bin/env bash
# bench_run.sh: real programs under `uswap run --memory M` against the same programs under
# the kernel's swap with a memory cgroup limited to M (issue 8 §4).
#
# For a program that runs to its end, `uswap bench run --memory M -- CMD ARGS…` replaces the
# per-program comparison (interleaved rounds, wall and CPU time, peak memory, exit status);
# this script stays for what that cannot time: a server under load from a client
# (redis-server with redis-benchmark) and stress-ng's bogo ops/s.
#
# Usage (as root, from anywhere):
#   docs/scripts/bench_run.sh [--memory 256M] [--keys 400000] [--value 1024]
#       [--requests 200000] [--clients 50] [--vm-bytes 512M] [--vm-method rand-set]
#       [--vm-seconds 20] [--verify] [--swap-size 2G] [--work-dir /var/tmp]
#       [--uswap target/release/uswap] [--only kernel|uswap]
#
# For each side it
#   1. starts redis-server (no persistence) and loads --keys keys of --value bytes, random
#      values (about keys x (value + 100) bytes, more than --memory), with redis-cli --pipe;
#   2. runs redis-benchmark -t set,get over that key space (--requests requests from
#      --clients clients, random keys) and records requests/s, p50 and p99 latency;
#   3. shuts redis down and runs stress-ng --vm 1 --vm-bytes B --vm-method M for
#      --vm-seconds and records its bogo ops/s (stress-ng forks its worker: on the uswap
#      side it needs fork support in `uswap run`, issue 8 §2). Methods that make a pass over
#      the whole buffer per bogo op (`all` starts with one) finish none in 10 s at twice
#      the memory on a disk swap; rand-set (random writes) counts finely;
# and prints the two sides next to each other.
#
# Kernel side: a memory cgroup (v2 `memory.max`, or v1 `memory.limit_in_bytes` where the
# memory controller is on v1) limited to --memory, and a swap file of --swap-size in
# --work-dir turned on for the run. uswap side: `uswap run --memory M --swap-dir
# <work dir>`; skipped, with a note, while the uswap binary has no `run` subcommand. Build
# it first with `cargo build --release` (the LD_PRELOAD library comes with it).
#
# Everything it sets up is torn down on exit, Ctrl-C included: the servers it started are
# killed, the swap file is turned off and deleted, the cgroup is removed, and the work
# directory is deleted. Keep other swap off for a clean comparison (it says what is on).
# redis-benchmark and redis-cli run outside the cgroup.
set -euo pipefail

MEMORY=256M
KEYS=400000
VALUE=1024
REQUESTS=200000
CLIENTS=50
VM_BYTES=512M
VM_METHOD=rand-set
VM_SECONDS=20
VERIFY=()
SWAP_SIZE=2G
WORK_PARENT=/var/tmp
REPO=$(cd "$(dirname "$0")/../.." && pwd)
USWAP=$REPO/target/release/uswap
ONLY=""

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit "${1:-0}"
}

while [ $# -gt 0 ]; do
  case $1 in
  --memory) MEMORY=$2; shift 2 ;;
  --keys) KEYS=$2; shift 2 ;;
  --value) VALUE=$2; shift 2 ;;
  --requests) REQUESTS=$2; shift 2 ;;
  --clients) CLIENTS=$2; shift 2 ;;
  --vm-bytes) VM_BYTES=$2; shift 2 ;;
  --vm-method) VM_METHOD=$2; shift 2 ;;
  --vm-seconds) VM_SECONDS=$2; shift 2 ;;
  --verify) VERIFY=(--verify); shift ;;
  --swap-size) SWAP_SIZE=$2; shift 2 ;;
  --work-dir) WORK_PARENT=$2; shift 2 ;;
  --uswap) USWAP=$2; shift 2 ;;
  --only) ONLY=$2; shift 2 ;;
  -h | --help) usage 0 ;;
  *) echo "bench_run.sh: unknown argument $1" >&2; usage 2 >&2 ;;
  esac
done
case $ONLY in "" | kernel | uswap) ;; *) echo "--only takes kernel or uswap" >&2; exit 2 ;; esac

die() { echo "bench_run.sh: $*" >&2; exit 1; }

# 64M, 1G, 512K or bytes to bytes.
bytes() {
  local n=${1%[KkMmGg]} unit=${1: -1}
  [[ $n =~ ^[0-9]+$ ]] || die "bad size $1"
  case $unit in
  [Kk]) echo $((n << 10)) ;; [Mm]) echo $((n << 20)) ;; [Gg]) echo $((n << 30)) ;;
  *) echo "$n" ;;
  esac
}
LIMIT=$(bytes "$MEMORY")

[ "$(id -u)" -eq 0 ] || die "run as root (cgroups and swapon)"
for p in redis-server redis-cli redis-benchmark stress-ng awk base64 mkswap swapon swapoff; do
  command -v "$p" >/dev/null || die "$p is not installed (apt-get install redis-server redis-tools stress-ng)"
done

# ---- teardown -------------------------------------------------------------------------

WORK=""
CGROUP=""
SWAPFILE=""
PIDS=()
ENABLED_V2_MEMORY=""

cleanup() {
  set +e
  local pid
  for pid in "${PIDS[@]}"; do
    # uswap run may have started the program as its child.
    pkill -KILL -P "$pid" 2>/dev/null
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  if [ -n "$CGROUP" ] && [ -d "$CGROUP" ]; then
    # Anything left inside (a stress-ng worker) goes too.
    for pid in $(cat "$CGROUP/cgroup.procs" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
    for _ in $(seq 50); do rmdir "$CGROUP" 2>/dev/null && break; sleep 0.1; done
    [ -d "$CGROUP" ] && echo "bench_run.sh: could not remove $CGROUP" >&2
  fi
  if [ -n "$ENABLED_V2_MEMORY" ]; then
    echo -memory >"$ENABLED_V2_MEMORY" 2>/dev/null
  fi
  if [ -n "$SWAPFILE" ] && grep -q "^$SWAPFILE " /proc/swaps; then
    swapoff "$SWAPFILE" || echo "bench_run.sh: swapoff $SWAPFILE failed" >&2
  fi
  [ -n "$WORK" ] && rm -rf "$WORK"
}
# Runs a command in the background and waits for it: bash runs a trap only once the
# foreground command has finished, but it interrupts `wait` at once.
run_fg() {
  local pid rc=0
  "$@" &
  pid=$!
  PIDS+=("$pid")
  wait "$pid" || rc=$?
  forget "$pid"
  return "$rc"
}

forget() {
  local p keep=()
  for p in "${PIDS[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done
  PIDS=("${keep[@]}")
}

trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

WORK=$(mktemp -d "$WORK_PARENT/bench_run.XXXXXX")

# ---- the kernel side's cgroup and swap ------------------------------------------------

# Creates the cgroup and sets CGROUP and CG_KIND (v1 or v2).
make_cgroup() {
  local root=/sys/fs/cgroup name
  name=uswap-bench-run-$$
  if [ -e $root/memory/memory.limit_in_bytes ]; then
    CG_KIND=v1
    CGROUP=$root/memory/$name
    mkdir "$CGROUP"
    echo 60 >"$CGROUP/memory.swappiness"
    echo "$LIMIT" >"$CGROUP/memory.limit_in_bytes"
  elif grep -qw memory $root/cgroup.controllers 2>/dev/null; then
    CG_KIND=v2
    if ! grep -qw memory $root/cgroup.subtree_control; then
      echo +memory >$root/cgroup.subtree_control
      ENABLED_V2_MEMORY=$root/cgroup.subtree_control
    fi
    CGROUP=$root/$name
    mkdir "$CGROUP"
    echo max >"$CGROUP/memory.swap.max"
    echo "$LIMIT" >"$CGROUP/memory.max"
  else
    die "no memory cgroup controller under $root"
  fi
}

# Bytes of the cgroup's memory now in swap.
cgroup_swapped() {
  if [ "$CG_KIND" = v2 ]; then
    cat "$CGROUP/memory.swap.current"
  else
    awk '$1 == "swap" { print $2 }' "$CGROUP/memory.stat"
  fi
}

make_swap() {
  SWAPFILE=$WORK/swapfile
  if ! fallocate -l "$(bytes "$SWAP_SIZE")" "$SWAPFILE" 2>/dev/null; then
    dd if=/dev/zero of="$SWAPFILE" bs=1M count=$(($(bytes "$SWAP_SIZE") >> 20)) status=none
  fi
  chmod 600 "$SWAPFILE"
  mkswap -q "$SWAPFILE" >/dev/null
  swapon "$SWAPFILE" || die "swapon $SWAPFILE failed (does $WORK_PARENT's file system take swap files?)"
}

# ---- redis ----------------------------------------------------------------------------

free_port() {
  local port
  while :; do
    port=$((20000 + RANDOM % 20000))
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || { echo "$port"; return; }
  done
}

# SET commands for every key, in RESP, with values drawn from a pool of random ones
# (so that neither side gets same-filled or very compressible pages).
redis_load_commands() {
  local pool=$WORK/pool
  head -c $((256 * VALUE)) /dev/urandom | base64 -w "$VALUE" | head -n 256 >"$pool"
  awk -v keys="$KEYS" -v size="$VALUE" '
    { pool[NR - 1] = substr($0, 1, size) }
    END {
      for (i = 0; i < keys; i++) {
        k = sprintf("key:%012d", i)
        v = pool[(i * 7919) % NR]
        printf "*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n", length(k), k, length(v), v
      }
    }' "$pool"
}

redis_load() {
  redis_load_commands | redis-cli -p "$1" --pipe
}

# redis_side NAME LAUNCHER...: starts redis-server through LAUNCHER, loads it, benchmarks
# it and stops it; results go to R[NAME.*].
declare -A R
redis_side() {
  local name=$1 port pid log csv launch
  shift
  launch=("$@")
  port=$(free_port)
  log=$WORK/redis-$name.log
  mkdir -p "$WORK/redis-$name"
  "${launch[@]}" redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
    --daemonize no --dir "$WORK/redis-$name" >"$log" 2>&1 &
  pid=$!
  PIDS+=("$pid")
  for _ in $(seq 200); do
    redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break
    kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; die "$name: redis-server exited"; }
    sleep 0.1
  done
  echo "$name: loading $KEYS keys of $VALUE bytes"
  run_fg redis_load "$port" >"$WORK/load.out" 2>&1 || true
  grep -q "errors: 0, replies: $KEYS" "$WORK/load.out" ||
    { cat "$WORK/load.out" "$log" >&2; die "$name: loading failed"; }
  R[$name.used]=$(redis-cli -p "$port" info memory | awk -F: '/^used_memory:/ { print $2 + 0 }')
  echo "$name: redis holds $((R[$name.used] >> 20)) MiB; redis-benchmark -t set,get -n $REQUESTS -c $CLIENTS"
  csv=$WORK/bench-$name.csv
  run_fg redis-benchmark -p "$port" -r "$KEYS" -n "$REQUESTS" -c "$CLIENTS" -d "$VALUE" \
    -t set,get --csv >"$csv"
  # "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms",
  # "p99_latency_ms","max_latency_ms"
  while IFS=, read -r test rps _avg _min p50 _p95 p99 _max; do
    test=${test//\"/}
    [ "$test" = test ] && continue
    R[$name.$test.rps]=${rps//\"/}
    R[$name.$test.p50]=${p50//\"/}
    R[$name.$test.p99]=${p99//\"/}
  done <"$csv"
  [ "$name" = kernel ] && R[kernel.swapped]=$(cgroup_swapped)
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  wait "$pid" || true
  forget "$pid"
  rm -rf "$WORK/redis-$name"
}

# ---- stress-ng ------------------------------------------------------------------------

stress_side() {
  local name=$1 out
  shift
  out=$WORK/stress-$name.out
  echo "$name: stress-ng --vm 1 --vm-bytes $VM_BYTES --vm-method $VM_METHOD -t ${VM_SECONDS}s ${VERIFY[*]}"
  if ! run_fg "$@" stress-ng --vm 1 --vm-bytes "$VM_BYTES" --vm-method "$VM_METHOD" "${VERIFY[@]}" \
    -t "${VM_SECONDS}s" --metrics-brief --temp-path "$WORK" >"$out" 2>&1; then
    echo "$name: stress-ng failed:" >&2
    tail -n 5 "$out" >&2
    R[$name.vm]=failed
    return
  fi
  # stress-ng: metrc: [pid] vm <bogo ops> <real s> <usr s> <sys s> <ops/s real> <ops/s cpu>
  R[$name.vm]=$(awk '$2 == "metrc:" && $4 == "vm" { print $9 }' "$out")
  grep -E 'metrc|fail|warn' "$out" | sed "s/^/$name: /"
}

# ---- the two sides --------------------------------------------------------------------


echo "memory $MEMORY, redis $KEYS keys x $VALUE B, stress-ng --vm-bytes $VM_BYTES; swap on now:"
sed 1d /proc/swaps | sed 's/^/  /'
[ -n "$(sed 1d /proc/swaps)" ] || echo "  (none)"

if [ "$ONLY" != uswap ]; then
  make_cgroup
  make_swap
  echo "kernel: cgroup $CG_KIND $CGROUP, memory limit $MEMORY, swap file $SWAP_SIZE"
  # The command joins the cgroup, then becomes the program (the same process).
  in_cgroup=(sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$CGROUP")
  redis_side kernel "${in_cgroup[@]}"
  stress_side kernel "${in_cgroup[@]}"
  swapoff "$SWAPFILE"
  rm -f "$SWAPFILE"
  SWAPFILE=""
fi

if [ "$ONLY" != kernel ]; then
  if [ -x "$USWAP" ] && "$USWAP" run --help >/dev/null 2>&1; then
    under_uswap=("$USWAP" run --memory "$MEMORY" --swap-dir "$WORK" --)
    redis_side uswap "${under_uswap[@]}"
    stress_side uswap "${under_uswap[@]}"
  else
    echo "uswap: skipped: $USWAP has no run subcommand (build it with cargo build --release)"
  fi
fi

# ---- report ---------------------------------------------------------------------------

row() { printf '%-28s %16s %16s\n' "$1" "${R[kernel.$2]:--}" "${R[uswap.$2]:--}"; }
echo
printf '%-28s %16s %16s\n' "memory $MEMORY" "kernel swap" "uswap run"
row "redis used_memory (bytes)" used
[ -n "${R[kernel.swapped]:-}" ] && printf '%-28s %16s\n' "kernel: cgroup in swap (B)" "${R[kernel.swapped]}"
for t in SET GET; do
  row "redis $t requests/s" "$t.rps"
  row "redis $t p50 latency (ms)" "$t.p50"
  row "redis $t p99 latency (ms)" "$t.p99"
done
row "stress-ng vm bogo ops/s" vm
