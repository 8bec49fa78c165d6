#!/bin/sh
# `lightwell serve` on all interfaces. MODEL (a folder, a .gguf or s3://bucket/prefix; default:
# the image's default model), PORT (8000) and EXTRA_ARGS (more options) come from the
# environment; the container's arguments are appended (and win over the environment).
set -eu
set -- --host 0.0.0.0 --port "${PORT:-8000}" ${MODEL:+--model "$MODEL"} ${EXTRA_ARGS:-} "$@"
exec lightwell serve "$@"
