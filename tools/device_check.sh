#!/usr/bin/env bash
# The accelerator check (issue 24, item 6): on a GPU or TPU host, in under 8 minutes, MFU of the 1B
# decoder per recipe vs a hand-written step, flash vs dense, XLA flags on/off, offload cost and the
# planner's step-time prediction vs measured; adds a dated table to BENCHMARKS.md.
#
#   tools/device_check.sh                      # on an accelerator host
#   tools/device_check.sh --dry-run            # anywhere: the same pipeline on CPU, tiny shapes, prints the table
#   tools/device_check.sh --help               # shapes, budget, output file
#
# On a CPU-only host without --dry-run it refuses (exit 2). PYTHON picks the interpreter (default
# python3); this checkout's meshtrain is imported first. Details: tools/device_check.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" "$ROOT/tools/device_check.py" "$@"
