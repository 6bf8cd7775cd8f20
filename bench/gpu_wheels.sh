#!/usr/bin/env bash
# Run here, before a GPU session: the wheels pdserve needs that the GPU machine's image lacks, for
# its Python 3.12, in .whl/ (git-ignored), which every device call carries (carry: [".whl"]) and
# bench/gpu_session.sh installs. pyzmq (every process), gguf (GGUF models; its dependencies are on
# the image), prometheus-client (the router), aiohttp and its dependencies (the router's HTTP API,
# bench router --frontend http), pytest-xdist and execnet (pyproject's addopts ask for -n auto;
# tests/conftest.py then runs a GPU's tests in one process), pinned to what the CPU suite runs.
# About 4 MB. In .whl/optional/,
# llguidance (structured outputs): its wheel wants glibc 2.31, which the image may lack, so
# gpu_session.sh installs it apart and goes on without it (3 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .whl \
    pyzmq==27.3.0 gguf==0.19.0 prometheus-client==0.26.0 \
    aiohttp==3.14.5 aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl \
    pytest-xdist==3.8.0 execnet==2.1.2
ls .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 -d .whl/optional llguidance==1.9.1
ls .whl/optional
