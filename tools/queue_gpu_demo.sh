#!/usr/bin/env bash
# Issue 36's GPU run: jobs sharing one GPU by memory reservation, through the queue.
#
#   tools/queue_gpu_demo.sh                    on this machine's GPU 0 (the H200 run, for docs/results)
#   SNAPSHOT=h200x1 tools/queue_gpu_demo.sh    on a snapshot (no GPU: the jobs only sleep)
#
# Five jobs of `torchplace run --gpus 0, --memory 30GiB --wait 600` (GPU 0 by name) start at once on one GPU: four fit in
# its memory (4 x 30 GiB <= 140 GiB of an H200), the fifth waits in the queue and is served when one
# ends. On a GPU each job calls setup() (which limits it to its reservation), fills 25 GiB, shows
# that allocating past the reservation raises an OOM, and holds its memory a few seconds. While they
# run, `torchplace queue` and `torchplace leases` are printed; nvidia-smi's view at the end of it.
# Output: stdout, and $OUT/queue_gpu_demo.txt when OUT is set.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
WORK="$(mktemp -d /tmp/torchplace-queue-demo.XXXXXX)"
chmod 755 "$WORK"
export TORCHPLACE_LEASE_DIR="$WORK/leases"
install -d -m 1777 "$TORCHPLACE_LEASE_DIR"  # what the admin makes: sudo install -d -m 1777 -o root -g root DIR
LOG="$WORK/demo.txt"
SNAP=()
[ -n "${SNAPSHOT:-}" ] && SNAP=(--snapshot "$SNAPSHOT")
export COLUMNS="${COLUMNS:-120}"
HOLD="${HOLD:-20}"  # seconds each job holds its memory

cat > "$WORK/job.py" <<'EOF'
import os, sys, time
tag = sys.argv[1]
print(f"[{tag}] started: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} "
      f"TORCHPLACE_MEMORY_RESERVATION={os.environ.get('TORCHPLACE_MEMORY_RESERVATION')}", flush=True)
if os.environ.get("DEMO_SNAPSHOT"):
    time.sleep(float(os.environ["DEMO_HOLD"]))
    print(f"[{tag}] done", flush=True)
    sys.exit(0)
import torch
import torchplace as tp
rt = tp.setup(verbose=False, threads=None)
print(f"[{tag}] " + next(d for d in rt.decisions if d.startswith("memory reservation")), flush=True)
held = torch.empty(25 * 2**30, dtype=torch.uint8, device=rt.device)
print(f"[{tag}] holds {torch.cuda.memory_allocated(rt.device) / 2**30:.1f} GiB", flush=True)
try:
    more = torch.empty(10 * 2**30, dtype=torch.uint8, device=rt.device)
    print(f"[{tag}] UNEXPECTED: 35 GiB allocated past a 30 GiB reservation", flush=True)
except torch.OutOfMemoryError as exc:
    print(f"[{tag}] past the reservation: torch.OutOfMemoryError: {str(exc).splitlines()[0][:400]}", flush=True)
time.sleep(float(os.environ["DEMO_HOLD"]))
print(f"[{tag}] done", flush=True)
EOF

{
  echo "# tools/queue_gpu_demo.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) ${SNAPSHOT:+(snapshot $SNAPSHOT)}"
  command -v nvidia-smi >/dev/null && [ -z "${SNAPSHOT:-}" ] && \
    nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv
  "$PY" -c "import torch; print('torch', torch.__version__)" 2>/dev/null
  pids=()
  for i in 1 2 3 4 5; do
    DEMO_SNAPSHOT="${SNAPSHOT:-}" DEMO_HOLD="$HOLD" "$PY" -m torchplace run --gpus 0, --memory 30GiB --wait 600 \
      "${SNAP[@]}" -- "$PY" "$WORK/job.py" "job$i" 2>&1 | sed -u "s/^torchplace:/[job$i] torchplace:/" &
    pids+=($!)
    sleep 0.5
  done
  for _ in $(seq 600); do  # until four reservations are made and the fifth job waits (at most 120 s)
    n=$(ls "$TORCHPLACE_LEASE_DIR" | grep -c '\.memory\.')
    [ "$n" -ge 4 ] && ls "$TORCHPLACE_LEASE_DIR" | grep -q '^queue\.' && break
    sleep 0.2
  done
  echo "\$ torchplace queue"
  "$PY" -m torchplace queue
  echo "\$ torchplace leases ${SNAP[*]}"
  "$PY" -m torchplace leases "${SNAP[@]}"
  command -v nvidia-smi >/dev/null && [ -z "${SNAPSHOT:-}" ] && \
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv
  fails=0
  for p in "${pids[@]}"; do wait "$p" || fails=$((fails + 1)); done
  echo "\$ torchplace queue   # after every job ended"
  "$PY" -m torchplace queue
  echo "jobs failed: $fails"
} 2>&1 | tee "$LOG"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT" && cp "$LOG" "$OUT/queue_gpu_demo.txt"
fi
rm -rf "$WORK"
