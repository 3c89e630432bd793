#!/usr/bin/env bash
# The servers the remote tier's tests start on loopback (tests/remote_servers.py):
# Valkey/Redis (Debian's redis-server) and the shared library the Mooncake wheel's
# mooncake_master links (libibverbs1; the TCP transport never uses RDMA). What the
# system lacks is fetched the way the other test dependencies come, without root and
# without installing anything system-wide: `apt-get download` (as this user, apt's
# cache in DEST) and `dpkg -x` into DEST/root (about 3 MiB). `make test` then puts
# DEST/root/usr/bin on PATH and its library directory on LD_LIBRARY_PATH for pytest.
# Where that is not possible (no apt-get/dpkg, no package lists, no network), one
# line says which tests will skip. FETCH_TEST_STORES=1 fetches even what the
# system has (to check this script).
#   bash tools/install_test_stores.sh [DEST]     # DEST: .test-stores
set -euo pipefail
dest=${1:-.test-stores}
need=()
if [ "${FETCH_TEST_STORES:-0}" = 1 ]; then
    need=(redis-server libibverbs1)
else
    command -v valkey-server >/dev/null 2>&1 || command -v redis-server >/dev/null 2>&1 \
        || [ -x "$dest/root/usr/bin/redis-server" ] || need+=(redis-server)
    ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || ls "$dest"/root/usr/lib/*/libibverbs.so.1 \
        >/dev/null 2>&1 || need+=(libibverbs1)
fi
if [ ${#need[@]} -eq 0 ]; then
    echo "install_test_stores: redis-server and libibverbs1 present"
    exit 0
fi
skip="missing ${need[*]}: the remote tier tests that need them skip"
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg >/dev/null 2>&1; then
    echo "install_test_stores: no apt-get/dpkg to fetch them; $skip"
    exit 0
fi
pkgs=()
for p in "${need[@]}"; do
    case $p in  # with the libraries they link that a minimal system may lack
        redis-server) pkgs+=(redis-server redis-tools libjemalloc2 liblzf1 libatomic1) ;;
        libibverbs1) pkgs+=(libibverbs1 libnl-3-200 libnl-route-3-200) ;;
    esac
done
dest=$(mkdir -p "$dest" && cd "$dest" && pwd)
mkdir -p "$dest/lists/partial" "$dest/archives/partial" "$dest/debs" "$dest/root"
apt_opts=(-o "Dir::Cache=$dest" -o "Dir::Cache::archives=$dest/archives" -o Debug::NoLocking=1
          -o "APT::Sandbox::User=$(id -un)")
if ! ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1; then  # no lists: fetch them into DEST
    apt_opts+=(-o "Dir::State::Lists=$dest/lists")
    apt-get "${apt_opts[@]}" -qq update >/dev/null 2>&1 || { echo "install_test_stores: apt-get update failed; $skip"; exit 0; }
fi
if ! (cd "$dest/debs" && apt-get "${apt_opts[@]}" -qq download "${pkgs[@]}" >/dev/null 2>&1); then
    echo "install_test_stores: apt-get download ${pkgs[*]} failed; $skip"
    exit 0
fi
for deb in "$dest"/debs/*.deb; do
    dpkg -x "$deb" "$dest/root"
done
rm -rf "$dest/debs" "$dest/archives"
echo "install_test_stores: ${need[*]} fetched into $dest/root (apt-get download, dpkg -x; nothing installed system-wide)"
