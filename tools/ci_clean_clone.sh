#!/usr/bin/env bash
# Runs .ci/run the way CI does, on a clean clone of HEAD in a temporary folder, and removes the clone after:
# each clone holds a 2.8 GB venv, and clones left in /tmp once filled the disk that CI shares (session 56).
# Usage: scripts/ci_clean_clone.sh [LOG]   (LOG defaults to /tmp/ci-clean-clone.log; the exit status is CI's)
set -uo pipefail
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
log=${1:-/tmp/ci-clean-clone.log}
clone=$(mktemp -d /tmp/fmha-ci.XXXXXX)
trap 'rm -rf "$clone"' EXIT
git clone -q "$repo" "$clone"
echo "CI on $(git -C "$clone" rev-parse --short HEAD) in $clone, log $log"
(cd "$clone" && CI=true bash .ci/run) >"$log" 2>&1
status=$?
echo "CI exit $status (log $log)"
exit "$status"
