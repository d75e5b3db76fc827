#!/bin/bash
# The fault-injection soak (crates/uswap-core/tests/soak.rs), many scenarios side by side for
# a fixed time: for a recorded run of 10^8 verified accesses on a machine with many cores.
#
#   docs/scripts/soak_parallel.sh SOAK_BINARY SECONDS PROCESSES OUTDIR
#
# SOAK_BINARY is the built test (cargo test --release -p uswap-core --test soak --no-run).
# Scenario i runs transient faults (EAGAIN, short transfers, flips in transit, read EIO,
# write EIO and ENOSPC) in thread or SIGBUS mode over io_uring or pread by turns; two
# processes in eight (the pread ones) run permanent faults (flips on the device, persistent
# EIO) too, aimed at one lost page in 2,000,000 accesses: such a process may end early by a
# loud SIGBUS, never by a wrong page. Each gets its own seed, and a time limit of SECONDS plus
# five minutes. The last lines sum the accesses of the runs that passed and count the failures.
set -u
bin=$1 seconds=$2 procs=$3 out=$4
mkdir -p "$out"
uring=uring
if ! USWAP_SOAK_ACCESSES=2000 timeout 60 "$bin" transient_faults_thread_mode_uring >"$out/probe-uring.txt" 2>&1; then
    echo "io_uring scenario failed here (see probe-uring.txt); using pread for all"
    uring=pread
fi
configs=("thread $uring" "sigbus $uring" "thread pread" "sigbus pread")
for i in $(seq 0 $((procs - 1))); do
    read -r mode io <<<"${configs[$((i % 4))]}"
    kind=transient
    [ $((i % 8)) -ge 6 ] && kind=permanent
    USWAP_SOAK_SEED=$((i + 1)) USWAP_SOAK_SECONDS=$seconds USWAP_SOAK_ACCESSES=100000000000 \
        USWAP_SOAK_LOSS_EVERY=2000000 timeout $((seconds + 300)) \
        "$bin" "soak_${kind}_faults_${mode}_mode_${io}" >"$out/run-$i.txt" 2>&1 &
done
wait
grep -h "^test " "$out"/run-*.txt
total=$(grep -h "^test .* \.\.\. ok: " "$out"/run-*.txt | grep -o "checked [0-9]* accesses\|progress: [0-9]* accesses" |
    awk '{s += $2} END {print s + 0}')
failed=$(grep -L "^test .* \.\.\. ok: " "$out"/run-*.txt | wc -l)
echo "processes $procs, seconds $seconds, verified accesses $total, failed scenarios $failed"
