#!/usr/bin/env bash
# Download, on this machine (which has the package registries), the wheels the GPU machine lacks:
# isal (torchplace's fast CRC-32; without it checksums fall back to zlib, about 6x slower a core) and
# fastsafetensors and instanttensor (peers `bench checkpoint` compares loads with; instanttensor 0.2.2 has a
# cp312 manylinux_2_28 wheel whose extension links no libtorch, so it installs beside torch 2.11 with --no-deps). The GPU machine runs Python 3.12 on
# x86_64 with no network; tools/gpu_suite.sh installs whatever lies in .whl/ when that folder is carried.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --dest .whl isal fastsafetensors instanttensor
ls -1 .whl
