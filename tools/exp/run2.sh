#!/usr/bin/env bash
# Second round for issues 3, 5, 6: loader parts, pick breakdown, then the checkpoint and transfer benches.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 COLUMNS=160
R=${OUT:-/tmp}/r; mkdir -p "$R"; o=$R/exp2.txt
{
echo "== pick"; python3 tools/exp/pick_time.py; python3 tools/exp/pick_time.py
ls -la "$(python3 -c 'import pynvml,os;print(os.path.dirname(pynvml.__file__))')/__pycache__" 2>&1 | grep -i nvml
echo "== loader v2"; timeout 150 python3 tools/exp/loader_v2.py
} > "$o" 2>&1
cat "$o"
timeout 120 python3 -m torchplace bench transfer --out "$R" 2>&1 | tee "$R/bench-transfer.txt" | tail -16
timeout 280 python3 -m torchplace bench checkpoint --out "$R" 2>&1 | tee "$R/bench-checkpoint.txt" | tail -22
