#!/usr/bin/env bash
# Fails on an import cycle between sibling modules of the crate (docs/architecture.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 .ci/module-cycles.py src
