#!/usr/bin/env bash
# `make test` on a loaded machine (issue 28): two CPU-bound processes spin for the whole run, as other
# work on a shared 2-core machine would, and are killed at the end. The suite must pass all the same:
# tests detect hangs (bounds of 120 s and more), they never time the machine.
#
#   tools/busy_test.sh            # make test, with 2 spinners
#   SPINNERS=4 tools/busy_test.sh # more load
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pids=()
stop() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done; wait "${pids[@]}" 2>/dev/null; }
trap stop EXIT INT TERM
for _ in $(seq "${SPINNERS:-2}"); do
  "$PY" -c 'while True: pass' &
  pids+=("$!")
done
echo "busy_test: ${#pids[@]} CPU-bound spinners (pids ${pids[*]}) on $(nproc) cores; running make test" >&2
start=$(date +%s)
make test
rc=$?
echo "busy_test: make test exited $rc after $(( $(date +%s) - start )) s under ${#pids[@]} spinners" >&2
exit $rc
