#!/usr/bin/env bash
# Run torchplace's GPU checks on a lent GPU machine; everything lands in one tarball under $OUT.
#   bash tools/gpu_suite.sh tests|bench-a|bench-b [pytest args...]
set -u
part=$1; shift || true
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 COLUMNS=160
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
tag=$(nvidia-smi -L | wc -l)gpu
tp() { python3 -m torchplace "$@"; }
case $part in
  tests)
    tp doctor --json > "$R/snapshot-h200-$tag.json"
    tp doctor --check-driver > "$R/doctor-$tag.txt" 2>&1
    for v in "" "1,0" "1" "0,0" "0,5" "GPU-"; do echo "== CUDA_VISIBLE_DEVICES='$v'"; CUDA_VISIBLE_DEVICES="$v" tp map --check-driver; done > "$R/map-$tag.txt" 2>&1
    timeout 560 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 240 "$@" 2>&1 | tee "$R/pytest-gpu-$tag.txt" | tail -40
    ;;
  final)
    tp doctor --json > "$R/snapshot-h200-$tag.json"
    tp doctor --check-driver > "$R/doctor-$tag.txt" 2>&1
    timeout 400 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 200 "$@" 2>&1 | tee "$R/pytest-gpu-$tag.txt" | tail -30
    for b in transfer loader; do
      timeout 90 python3 -m torchplace bench $b --out "$R" 2>&1 | tee "$R/bench-$b-$tag.txt" | tail -22
    done
    ;;
  bench-a)
    for b in transfer loader strict; do
      extra=""; [ $b = transfer ] || [ $b = loader ] && extra="--plot $R/bench-$b.png"
      timeout 200 python3 -m torchplace bench $b --out "$R" $extra 2>&1 | tee "$R/bench-$b-$tag.txt" | tail -25
    done
    ;;
  bench-ddp)
    ( time python3 -m torchplace pick ) > "$R/pick-time-$tag.txt" 2>&1
    timeout 400 python3 -m torchplace bench ddp --out "$R" 2>&1 | tee "$R/bench-ddp-$tag.txt" | tail -25
    ;;
  bench-b)
    for b in checkpoint cpu; do
      timeout 240 python3 -m torchplace bench $b --out "$R" "$@" 2>&1 | tee "$R/bench-$b-$tag.txt" | tail -25
    done
    ;;
esac
tar czf "${OUT:-/tmp/out}/results-$part-$tag.tgz" -C "$R" .
