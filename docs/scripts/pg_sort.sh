#!/usr/bin/env bash
# pg_sort.sh: a PostgreSQL sort in one backend's memory (work_mem), as one command for
# `uswap bench run`: a throw-away cluster is made, started, sorts, and is removed, all under
# the mode being measured (as the processes of one cgroup under the kernel's swap).
#
# Usage, as root (the server then runs as the postgres user, keeping CAP_SYS_PTRACE, which
# userfaultfd asks of a user without access to /dev/userfaultfd) or as the postgres user:
#   pg_sort.sh [table|series] [ROWS] [WORK_MEM] [PORT]
# ROWS (default 1000000) rows of 256 bytes of text (an md5 repeated: compressible) are
# sorted with WORK_MEM (default 1GB), so the sort runs in memory: about 0.35 GB at the
# default, three times a 128 MiB limit. `table` (the default) sorts a table of the rows
# with the default 128 MB of shared buffers; `series` sorts rows the query makes with
# generate_series (about 0.44 GB of heap), with 16 MB of shared buffers and no table, so
# that nearly all the memory is the sorting backend's heap: the kernel's cgroup charges
# shared buffers and the table's page cache, uswap's limit holds the heap alone. Prints
# the row count and an md5 of the sorted keys, the same under every mode and source.
# Under the kernel's swap, as root:
#   uswap bench run --memory 128M --modes kernel -- docs/scripts/pg_sort.sh
# Under uswap, change user first (a change of user under uswap that keeps capabilities, as
# setpriv's does, is refused: uswap's threads cannot follow it):
#   setpriv --reuid=postgres --regid=postgres --init-groups --inh-caps=+sys_ptrace \
#     --ambient-caps=+sys_ptrace -- uswap run --memory 128M -- docs/scripts/pg_sort.sh
set -euo pipefail
SOURCE=table
case ${1:-} in table | series) SOURCE=$1 && shift ;; esac
ROWS=${1:-1000000}
WORK_MEM=${2:-1GB}
PORT=${3:-5499}
if [ "$SOURCE" = table ]; then
  SHARED_BUFFERS=128MB
  MAKE="create table t as select g, repeat(md5(g::text), 8) m from generate_series(1, $ROWS) g"
  ROWS_SQL="select m from t"
else
  SHARED_BUFFERS=16MB
  MAKE="select 1"
  ROWS_SQL="select repeat(md5(g::text), 8) m from generate_series(1, $ROWS) g"
fi
BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -x "$BIN/postgres" ] || { echo "pg_sort.sh: PostgreSQL is not installed" >&2; exit 2; }
command -v setpriv >/dev/null || { echo "pg_sort.sh: setpriv is not installed" >&2; exit 2; }
dir=$(mktemp -d)
if [ "$(id -u)" -eq 0 ]; then
  chown postgres: "$dir"
  as_pg() {
    setpriv --reuid=postgres --regid=postgres --init-groups \
      --inh-caps=+sys_ptrace --ambient-caps=+sys_ptrace -- "$@"
  }
else
  as_pg() { "$@"; }
fi
cleanup() {
  as_pg "$BIN/pg_ctl" -D "$dir/data" -m fast stop >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap cleanup EXIT
as_pg "$BIN/initdb" -D "$dir/data" -A trust --no-sync >/dev/null
as_pg "$BIN/postgres" -D "$dir/data" -k "$dir" -p "$PORT" -c listen_addresses= \
  -c fsync=off -c shared_buffers="$SHARED_BUFFERS" >"$dir/server.log" 2>&1 &
for _ in $(seq 300); do
  "$BIN/pg_isready" -h "$dir" -p "$PORT" >/dev/null 2>&1 && break
  sleep 0.1
done
as_pg "$BIN/psql" -h "$dir" -p "$PORT" -d postgres -v ON_ERROR_STOP=1 -At \
  -c "$MAKE" \
  -c "set work_mem = '$WORK_MEM'" \
  -c "select count(*), md5(string_agg(left(m, 8), '')) from ($ROWS_SQL order by m) s"
