#!/usr/bin/env bash
# What a pip user gets: build the wheel and the sdist, install the wheel into a fresh venv that has
# only torch, and from a folder outside the repository run the first console commands of README.md,
# the docs' home page, docs/install.md and docs/quickstart.md, the first python example of the home
# page and of the quickstart, `python -m torchplace --help` and `torchplace bench diagnose --quick`.
# CI runs it after `make test` (.ci/run); by hand: bash tools/check_wheel.sh [PYTHON]
# (KEEP_WORK=1 leaves the venv and the folder it ran in, and says where).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${1:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"  # the Makefile's pin: a local CPU wheel where one is provided
WORK="$(mktemp -d)"
VENV_PID=""
cleanup() {  # the background venv install (below) is stopped first, when the script ends before it
  if [ -n "$VENV_PID" ]; then kill "$VENV_PID" 2>/dev/null || true; wait "$VENV_PID" 2>/dev/null || true; fi
  if [ -n "${KEEP_WORK:-}" ]; then echo "check_wheel: kept $WORK (venv: $WORK/venv)"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
pip_() {  # quiet, less the warnings about index folders this machine lacks
  "$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
  return "${PIPESTATUS[0]}"
}

# the user's venv with torch installs in the background while the wheel builds (unpacking torch is most of the time)
echo "check_wheel: a fresh venv with $TORCH_SPEC, made while the wheel builds"
( "$PYTHON" -m venv "$WORK/venv" && pip_ "$TORCH_SPEC" ) > "$WORK/venv.log" 2>&1 &
VENV_PID=$!

echo "check_wheel: building the wheel and the sdist in $WORK/dist"
"$PYTHON" -m venv "$WORK/build-env"
"$WORK/build-env/bin/python" -m pip install -q --disable-pip-version-check "setuptools>=77"
# the source is copied first, so that no build output (build/, *.egg-info) lands in the checkout
tar -C "$ROOT" --exclude=.venv --exclude=.git --exclude=build --exclude='*.egg-info' -cf - . | (mkdir "$WORK/src" && tar -C "$WORK/src" -xf -)
for kind in wheel sdist; do  # setuptools' own PEP 517 hooks, one process each, their chatter to a log
  (cd "$WORK/src" && "$WORK/build-env/bin/python" -c "import sys; from setuptools import build_meta as b
getattr(b, 'build_' + sys.argv[1])(sys.argv[2])" "$kind" "$WORK/dist") >> "$WORK/build.log" 2>&1 \
    || { tail -n 30 "$WORK/build.log"; echo "check_wheel: building the $kind failed"; exit 1; }
done
WHEEL="$(ls "$WORK"/dist/torchplace-*.whl)"
SDIST="$(ls "$WORK"/dist/torchplace-*.tar.gz)"
"$WORK/build-env/bin/python" - "$WHEEL" "$SDIST" <<'PY'
import sys, tarfile, zipfile
wheel, sdist = zipfile.ZipFile(sys.argv[1]).namelist(), tarfile.open(sys.argv[2]).getnames()
meta = zipfile.ZipFile(sys.argv[1]).read(next(n for n in wheel if n.endswith("METADATA"))).decode()
problems = [f"the wheel lacks {n}" for n in ("torchplace/hardware/snapshots/h200x2.json",
            "torchplace/bench/_corpus/__init__.py", "torchplace/py.typed") if n not in wheel]
problems += [f"the sdist ships {n}: MANIFEST.in prunes tests/" for n in sdist if "/tests/" in n][:3]
problems += [f"a relative Project-URL: {line}" for line in meta.splitlines()
             if line.startswith("Project-URL:") and "://" not in line]
problems += ["the long description has a relative link"] if "](docs/" in meta or "](examples/" in meta else []
if problems:
    sys.exit("check_wheel: " + "; ".join(problems))
print(f"check_wheel: {len(wheel)} files in the wheel, {len(sdist)} in the sdist, metadata fit for an index")
PY

wait "$VENV_PID" || { VENV_PID=""; cat "$WORK/venv.log"; echo "check_wheel: the venv with $TORCH_SPEC did not install"; exit 1; }
VENV_PID=""
cat "$WORK/venv.log"
echo "check_wheel: the wheel with --no-deps into that venv, then its runtime dependencies"
pip_ --no-deps "$WHEEL"
mapfile -t DEPS < <("$WORK/venv/bin/python" -c "
from importlib.metadata import requires
print('\n'.join(r for r in requires('torchplace') if 'extra ==' not in r and not r.startswith('torch')))")
pip_ "${DEPS[@]}"
"$WORK/venv/bin/python" -m pip check

mkdir "$WORK/user" && cd "$WORK/user"
export PATH="$WORK/venv/bin:$PATH" COLUMNS=120
run() { echo "\$ $*"; bash -c "$*" > "$WORK/out.txt" 2>&1 || { cat "$WORK/out.txt"; echo "check_wheel: failed: $*"; exit 1; }
        tail -n 3 "$WORK/out.txt"; }
PAGES=("$ROOT/README.md" "$ROOT/docs/README.md" "$ROOT/docs/install.md" "$ROOT/docs/quickstart.md")
# the first runnable console block of each page, as a reader types it
while IFS= read -r line; do run "$line"; done < <(python - "${PAGES[@]}" <<'PY'
import re, sys
for page in sys.argv[1:]:
    block = re.search(r"^```console runnable\n(.*?)^```", open(page).read(), re.MULTILINE | re.DOTALL)
    for line in block.group(1).splitlines():
        if line.startswith("$ "):
            print(line[2:].split("  #")[0].strip())
PY
)
# the first runnable python block of the home page and of the quickstart, saved as a reader saves it
python - "$ROOT/docs/README.md" "$ROOT/docs/quickstart.md" <<'PY'
import re, sys
for n, page in enumerate(sys.argv[1:]):
    block = re.search(r"^```python runnable\n(.*?)^```", open(page).read(), re.MULTILINE | re.DOTALL)
    open(f"example{n}.py", "w").write(block.group(1))
PY
run python example0.py
run python example1.py
run python -c "'import torchplace, sys; assert \"$ROOT\" not in torchplace.__file__, torchplace.__file__'"
run python -m torchplace --help
run torchplace bench diagnose --quick
# from site-packages too, the corpus reads as the user's code: every mistake named with path, tensor and line
run "torchplace bench diagnose --quick --json | python -c 'import json, sys
rows = {r[\"variant\"]: r[\"value\"] for r in json.load(sys.stdin)[\"rows\"]}
full = {k: v for k, v in rows.items() if \"user line\" in k}
assert full and all(v == 1.0 for v in full.values()), full
print(full)'"
echo "check_wheel: passed"
