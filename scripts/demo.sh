#!/usr/bin/env bash
# The main job: install dependencies, build, and generate a story with the shared stories260K model.
set -euo pipefail
cd "$(dirname "$0")/.."
# The model first: a checkout without ../shared (the repository's place beside it) stops here
# rather than after a build.
model=../shared/models/stories260K.gguf
if [[ ! -f $model ]]; then
  echo "demo: $model not found: the checkout belongs beside the shared/ folder (or get" \
    "tinyllamas/stories260K.gguf from the Hugging Face repository ggml-org/models into" \
    "../shared/models/)" >&2
  exit 1
fi
scripts/setup.sh --build-only >&2  # the build's packages (the tests' Node.js client is not needed)
scripts/build.sh berth >&2  # only the executable and its libraries; build logs go to stderr
./build/bin/berth run -m "$model" -p "Once upon a time" -n 64 --temp 0
echo
