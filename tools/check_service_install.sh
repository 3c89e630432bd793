#!/usr/bin/env bash
# docs/install.md's systemd install steps, run as written, then the unit's ExecStart as
# its User=/Group=, where systemd itself is absent (CI). Everything happens in a private
# mount namespace: /etc, /opt, /usr and /var are overlays over the real ones (writes land in
# a tmpfs), /run is a fresh tmpfs; nothing outside changes. The steps' `apt-get` is not run
# (nothing is installed as root; the system's python3 must already make venvs) and
# `systemctl` is this script's emulation of the unit:
#   enable --now: RuntimeDirectory= (owner, mode) and RUNTIME_DIRECTORY, Environment=,
#     LimitNOFILE=/LimitMEMLOCK=, NoNewPrivileges=, ProtectSystem=full (/usr and /etc
#     read-only), the working directory /, User=/Group= (setpriv), in a network namespace of
#     its own (the shipped config's metrics port collides with nothing); then `kvd health`
#   status: `kvd health` as the unit's user
# Then SIGTERM (exit status 0 expected), `kvd drop-tier` as the unit's user (nothing left in
# /dev/shm), `systemd-analyze verify` of the installed unit, and Documentation= must name an
# installed file. Needs root, unshare, setpriv; else one line says why it skips.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ] || ! command -v unshare >/dev/null || ! command -v setpriv >/dev/null; then
  echo "check_service_install: skipped (needs root, unshare and setpriv for a private mount namespace)"
  exit 0
fi
if ! /usr/bin/python3 -c "import ensurepip, venv" 2>/dev/null; then
  echo "check_service_install: skipped (/usr/bin/python3 cannot make venvs: apt-get install python3-venv)"
  exit 0
fi
for d in /etc /opt /usr; do  # an overlay would hide what is mounted below these (pip's sources may be)
  if [ -n "$(findmnt -rn -o TARGET | grep -E "^$d/" | grep -v -E '^/etc/(resolv.conf|hosts|hostname)$' || true)" ]; then
    echo "check_service_install: skipped (mounts under $d: an overlay of $d would hide them)"
    exit 0
  fi
done
tmp=$(mktemp -d /tmp/kvd-service-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
# the install steps: the first ```sh block of the "## systemd" section
awk '/^## systemd$/ {s = 1} s && /^```sh$/ {b = 1; next} b && /^```$/ {exit} b {print}' \
  docs/install.md > "$tmp/steps.sh"
grep -q "^groupadd" "$tmp/steps.sh" || { echo "check_service_install: no install steps found" >&2; exit 1; }
export CHECKOUT=$PWD TMPROOT=$tmp
unshare --mount --propagation private bash -euo pipefail -c '
for d in etc opt usr var; do
  mkdir -p "$TMPROOT/ov"; mountpoint -q "$TMPROOT/ov" || mount -t tmpfs tmpfs "$TMPROOT/ov"
  mkdir -p "$TMPROOT/ov/$d.up" "$TMPROOT/ov/$d.work"
  mount -t overlay overlay -o "lowerdir=/$d,upperdir=$TMPROOT/ov/$d.up,workdir=$TMPROOT/ov/$d.work" "/$d"
done
mount -t tmpfs -o mode=0755 tmpfs /run
source "$CHECKOUT/tools/systemd_emulation.sh"
cd "$CHECKOUT"
while IFS= read -r step; do
  echo "+ $step"
  eval "$step"
done < "$TMPROOT/steps.sh"
unit_stop
unit_checks
'
echo "check_service_install: the documented install steps run as written; the unit's ExecStart served as its user, stopped with 0, left nothing"
