#!/usr/bin/env bash
# Experiments for issues 3, 5, 6 on a lent GPU machine; output in $OUT/exp.txt
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
o=${OUT:-/tmp}/exp.txt
{
echo "== pick timing"; for i in 1 2 3 4 5; do /usr/bin/time -f "%e s wall" python3 -m torchplace pick >/dev/null; done
python3 -X importtime -m torchplace pick 2>&1 >/dev/null | sort -t'|' -k2 -n | tail -15
echo "== loader"; timeout 200 python3 tools/exp/loader_small.py
echo "== ckpt"; timeout 330 python3 tools/exp/ckpt_write.py "${1:-10}"
} > "$o" 2>&1
tail -60 "$o"
