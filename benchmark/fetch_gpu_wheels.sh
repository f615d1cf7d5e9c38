#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels that the api_server needs and the GPU machine's image lacks
# (it has no network; jsonschema: the server's tool_choice imports it), and pytest-xdist, execnet and pytest-timeout,
# with which gpu_check.sh spreads its test parts over the cores and cuts a hung test; gpu_check.sh installs them
# when .whl/ exists. Run here, then carry .whl to the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"  # a worktree's .git is a file
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 \
    annotated-doc==0.0.7 typing-inspection==0.4.2 typing_extensions==4.16.0 anyio==4.16.0 uvicorn==0.55.0 \
    gguf==0.19.0 opentelemetry-api==1.45.2 prompt_toolkit==3.0.52 wcwidth==0.7.0 jsonschema==4.26.0 \
    jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0 \
    pytest-xdist==3.8.0 execnet==2.1.2 pytest-timeout==2.4.0
ls .whl
