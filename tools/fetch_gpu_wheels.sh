#!/usr/bin/env bash
# Download, on this machine (which has the package registries), the wheels the GPU machine lacks:
# isal (torchplace's fast CRC-32; without it checksums fall back to zlib, about 6x slower a core) and
# fastsafetensors (a peer `bench checkpoint` compares loads with). The GPU machine runs Python 3.12 on
# x86_64 with no network; tools/gpu_suite.sh installs whatever lies in .whl/ when that folder is carried.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --dest .whl isal fastsafetensors
ls -1 .whl
