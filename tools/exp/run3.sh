#!/usr/bin/env bash
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 COLUMNS=160
R=${OUT:-/tmp}/r; mkdir -p "$R"
{ echo "== nvml"; python3 tools/exp/nvml_calls.py
  echo "== loader v3"; timeout 150 python3 tools/exp/loader_v3.py
  echo "== loader gpu tests"; timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/placement/test_loader_gpu.py 2>&1 | tail -5
} 2>&1 | tee "$R/exp3.txt"
timeout 100 python3 -m torchplace bench transfer --out "$R" 2>&1 | tee "$R/bench-transfer.txt" | tail -14
