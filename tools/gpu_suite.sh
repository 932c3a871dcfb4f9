#!/usr/bin/env bash
# Run torchplace's GPU checks on a lent GPU machine; everything lands in one tarball under $OUT.
#   bash tools/gpu_suite.sh tests|twice [pytest args...]   (the whole GPU suite; twice: two runs, one after the other)
#   CORPORA='corpus_a corpus_b' bash tools/gpu_suite.sh close   (a session's last call: the whole GPU suite, the corpora, stalls)
#   bash tools/gpu_suite.sh bench34   (issue 34: bench checkpoint at default sizes, then bench strict; <= 360 s)
#   bash tools/gpu_suite.sh bench-ddp | final-bench PAGE...   (bench ddp; benches, then docs/PAGE.md's runnable blocks)
# The GPU machine has no network and lacks isal (fast CRC-32) and fastsafetensors: fetch their wheels
# here first with `bash tools/fetch_gpu_wheels.sh` (into .whl/, git-ignored) and carry .whl along.
set -u
part=$1; shift || true
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 COLUMNS=160
if ls .whl/*.whl > /dev/null 2>&1; then  # the carried wheels, beside the machine's own packages
  pip install -q --no-index --no-deps --target /tmp/gpu-suite-deps .whl/*.whl > /dev/null 2>&1
  export PYTHONPATH=$PYTHONPATH:/tmp/gpu-suite-deps
fi
R=/tmp/gpu-suite-$part; mkdir -p "$R"  # packed into one tarball under $OUT at the end
tag=$(nvidia-smi -L | wc -l)gpu
tp() { python3 -m torchplace "$@"; }
case $part in
  tests)
    tp doctor --json > "$R/snapshot-h200-$tag.json"
    tp doctor --check-driver > "$R/doctor-$tag.txt" 2>&1
    for v in "" "1,0" "1" "0,0" "0,5" "GPU-"; do echo "== CUDA_VISIBLE_DEVICES='$v'"; CUDA_VISIBLE_DEVICES="$v" tp map --check-driver; done > "$R/map-$tag.txt" 2>&1
    # GPU_SUITE_S: the seconds the device time left allows; SIGINT then makes pytest say what ran before it stopped
    timeout -s INT -k 20 "${GPU_SUITE_S:-560}" python3 -m pytest -m gpu -q -rfsxX -p no:cacheprovider --timeout 240 \
      --durations=25 "$@" 2>&1 | tee "$R/pytest-gpu-$tag.txt" | tail -80
    ;;
  twice)  # the whole GPU suite, default order, no filters, two runs one after the other (issue 28)
    tp doctor --json > "$R/snapshot-h200-$tag.json"
    for run in 1 2; do
      echo "== run $run, $(date -u)"
      timeout 280 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 240 2>&1 \
        | tee "$R/pytest-gpu-$tag-run$run.txt" | tail -6
    done
    ;;
  close)  # a session's last GPU call: the whole GPU suite in default order (GPU_SUITE_S bounds it), then the corpora
    # named in CORPORA (default: every one) on cuda:0 vs cpu, each with its JSON (every case's outcome), then the
    # save_async stall of the two model-shaped layouts
    tp doctor --json > "$R/snapshot-h200-$tag.json"
    timeout -s INT -k 20 "${GPU_SUITE_S:-330}" python3 -m pytest -m gpu -q -rfsxX -p no:cacheprovider --timeout 240 \
      --durations=15 "$@" 2>&1 | tee "$R/pytest-gpu-$tag.txt" | tail -25
    for c in ${CORPORA:-$(cd tests/checks && ls corpus_*.py | sed 's/\.py$//' | grep -v corpus_kit)}; do
      mkdir -p "$R/$c"
      timeout 120 python3 -m torchplace bench diagnose --pairs cuda-cpu --corpus "tests/checks/$c.py" --out "$R/$c" 2>&1 \
        | tee "$R/bench-diagnose-$c-$tag.txt" | grep -E "^note: (strict|watch|explain|false)"
    done
    timeout 90 python3 -m torchplace bench checkpoint --sizes none --layouts gpt2,llama --out "$R" 2>&1 \
      | tee "$R/bench-checkpoint-layouts-$tag.txt" | grep -E "stall|^target"
    ;;
  bench34)  # issue 34: checkpoint (1GiB, 10GiB, llama, gpt2; peers from .whl) then strict, each with its JSON
    rm -rf "$R"; mkdir -p "$R"
    for m in instanttensor fastsafetensors isal; do python3 -c "import $m; print('$m', getattr($m, '__version__', 'ok'))" 2>&1 | tail -1; done | tee "$R/peers-$tag.txt"
    df -h /tmp /var/tmp > "$R/disk-$tag.txt" 2>&1; free -g >> "$R/disk-$tag.txt"
    timeout 225 python3 -m torchplace bench checkpoint --budget-s 190 --out "$R" "$@" 2>&1 | tee "$R/bench-checkpoint-$tag.txt" | tail -60
    echo "bench checkpoint exit: ${PIPESTATUS[0]}"
    timeout 130 python3 -m torchplace bench strict --out "$R" 2>&1 | tee "$R/bench-strict-$tag.txt" | tail -32
    echo "bench strict exit: ${PIPESTATUS[0]}"
    ;;
  bench-ddp)
    ( time python3 -m torchplace pick ) > "$R/pick-time-$tag.txt" 2>&1
    timeout 400 python3 -m torchplace bench ddp --out "$R" 2>&1 | tee "$R/bench-ddp-$tag.txt" | tail -25
    ;;
  final-bench)
    rm -rf "$R"; mkdir -p "$R"  # a machine may keep /tmp from an earlier loan
    for run in 1 2; do  # twice: the small-tensor and memory figures vary from run to run on a VM
      mkdir -p "$R/run$run"
      timeout 100 python3 -m torchplace bench transfer --out "$R/run$run" 2>&1 | tee "$R/bench-transfer-$tag-run$run.txt" | tail -8
      timeout 150 python3 -m torchplace bench loader --out "$R/run$run" 2>&1 | tee "$R/bench-loader-$tag-run$run.txt" | tail -8
    done
    mkdir -p "$R/epochs100"  # the memory check over 100 epochs instead of 20
    timeout 200 python3 -m torchplace bench loader --epochs 100 --rounds 1 --out "$R/epochs100" 2>&1 \
      | tee "$R/bench-loader-100epochs-$tag.txt" | tail -4

    for page in "$@"; do
      timeout 150 python3 tests/test_docs.py "docs/$page.md" > "$R/docs-$page-$tag.txt" 2>&1
      echo "docs/$page.md: $(tail -1 "$R/docs-$page-$tag.txt")"
    done
    ;;
esac
tar czf "${OUT:-/tmp/out}/results-$part-$tag.tgz" -C "$R" .
