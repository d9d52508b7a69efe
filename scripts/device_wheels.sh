#!/usr/bin/env bash
# The wheels of the dependencies a GPU machine lacks (its image has torch, triton, numpy,
# safetensors, tokenizers, jinja2, httpx, psutil, prometheus_client, nvidia-ml-py, ninja), saved
# into .whl/ (ignored by git) for a device call to carry. Every engine command needs them:
# engine/cli.py imports uvicorn, kernels/native_build.py platformdirs; fla-core (and its einops)
# runs the Gated DeltaNet layers there (kernels/gated_deltanet.py). The CUDA tests compare with
# transformers and draw cases with hypothesis: those come with their own needs, numpy aside (the
# image has it), about 34 MB more.
# Usage, here: scripts/device_wheels.sh   (the versions of this venv's, else the newest)
# There, first: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#   --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
names="starlette uvicorn sqlalchemy greenlet platformdirs python-multipart plotly fla-core einops"
for name in $names; do
  version=$(python3 -c "import importlib.metadata as m, sys
try: print('==' + m.version(sys.argv[1]))
except m.PackageNotFoundError: print('')" "$name")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$name$version"
done
pins=$(python3 -c "import importlib.metadata as m
print(' '.join(n + '==' + m.version(n) for n in ('transformers', 'hypothesis', 'tokenizers',
                                               'safetensors')))")
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
rm -f .whl/numpy-*.whl
ls -1 .whl
