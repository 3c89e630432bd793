#!/usr/bin/env bash
# The servers the remote tier's tests start on loopback (tests/remote_servers.py):
# Valkey/Redis (Debian's redis-server; valkey-server where the release has it) and
# the shared library the Mooncake wheel's mooncake_master links (libibverbs1; the
# TCP transport never uses RDMA). Installed with apt-get when missing and we are root
# (CI is); otherwise one line says which tests will skip.
set -euo pipefail
need=()
command -v valkey-server >/dev/null 2>&1 || command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || need+=(libibverbs1)
if [ ${#need[@]} -eq 0 ]; then
    echo "install_test_stores: redis-server and libibverbs1 present"
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_test_stores: missing ${need[*]} (not root or no apt-get): the remote tier tests that need them skip"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
echo "install_test_stores: installed ${need[*]}"
