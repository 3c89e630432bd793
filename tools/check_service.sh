#!/usr/bin/env bash
# Verify configs/kvd.service with systemd-analyze, pointing ExecStart at
# this checkout's kvd: the unit as shipped names /usr/local/bin/kvd, which
# need not exist here (its header says so). Any line about the unit
# ("kvd.service:...") fails the check, warnings included.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
if ! command -v systemd-analyze >/dev/null; then
  echo "check_service: systemd-analyze not found; skipping" >&2
  exec bash tools/check_service_install.sh
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
kvd=$(cd "$venv/bin" && pwd)/kvd
sed "s#/usr/local/bin/kvd#$kvd#g" configs/kvd.service > "$tmp/kvd.service"
# verify prints problems and exits non-zero on errors in the unit
out=$(systemd-analyze verify "$tmp/kvd.service" 2>&1 || echo "VERIFY-FAILED")
echo "$out" | grep -v -e "^$" -e "Cannot add dependency job" -e "Failed to connect to bus" || true
if echo "$out" | grep -q -e "VERIFY-FAILED" -e "kvd.service:"; then
  echo "check_service: configs/kvd.service has problems" >&2
  exit 1
fi
echo "check_service: configs/kvd.service verified"
bash tools/check_service_install.sh 2>&1 | grep -v "^WARNING: Location"
