#!/usr/bin/env bash
# Run .ci/run the way CI does: on a clean clone of HEAD (committed work only) in a temporary folder, removed after.
# Each clone holds a venv of about 2.8 GB: clones left behind fill a shared disk quickly.
set -uo pipefail
usage() {
  cat <<'HELP'
usage: tools/ci_clean_clone.sh [-h] [LOG]

Run the CI script (.ci/run: a fresh venv, the README's test and report commands, ruff) on a clean clone of HEAD
in a temporary folder, as CI does, and remove the clone afterwards. Only committed work is tested. The output
goes to LOG (default /tmp/ci-clean-clone.log); the exit status is CI's.

example:
  tools/ci_clean_clone.sh /tmp/ci.log && echo CI passed
HELP
}
case "${1:-}" in -h|--help) usage; exit 0 ;; -*) usage >&2; exit 2 ;; esac
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
