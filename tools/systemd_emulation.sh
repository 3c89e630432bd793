# Sourced by tools/check_service_install.sh inside its private mount namespace: what the
# install steps' `apt-get` and `systemctl` lines do there, and the checks after them.
# The unit's settings are read from the installed /etc/systemd/system/kvd.service.
UNIT=/etc/systemd/system/kvd.service
DAEMON_PID=""

unit_get() {  # the last value of a Key= line of the unit
  sed -n "s/^$1=//p" "$UNIT" | tail -1
}

apt-get() {
  echo "(apt-get $*: not run; /usr/bin/python3 already makes venvs here)"
}

as_unit_user() {
  setpriv --reuid "$(unit_get User)" --regid "$(unit_get Group)" --init-groups "$@"
}

unit_start() {
  local user group rdir env exec
  user=$(unit_get User) group=$(unit_get Group)
  rdir=/run/$(unit_get RuntimeDirectory)
  install -d -o "$user" -g "$group" -m "$(unit_get RuntimeDirectoryMode)" "$rdir"
  env=$(unit_get Environment)
  exec=$(unit_get ExecStart)
  [ "$(unit_get ProtectSystem)" = full ] && [ "$(unit_get NoNewPrivileges)" = yes ]
  [ "$(unit_get LimitMEMLOCK)" = infinity ]
  # the shipped config's host tier is 1 GiB: the test's is smaller ("edit host_capacity")
  sed -i 's/^host_capacity = .*/host_capacity = "64MiB"/' /etc/kvd/kvd.toml
  unshare --mount --net bash -euc '
    mount -o remount,bind,ro /usr; mount -o remount,bind,ro /etc
    ip link set lo up
    hard=$(ulimit -Hn); ulimit -n "$(( $1 < hard ? $1 : hard ))"  # a container may cap the hard limit
    ulimit -l "$(ulimit -Hl)"
    cd /
    exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      RUNTIME_DIRECTORY="$2" $3 \
      setpriv --reuid "$4" --regid "$5" --init-groups --no-new-privs $6' \
    _ "$(unit_get LimitNOFILE)" "$rdir" "$env" "$user" "$group" "$exec" &
  DAEMON_PID=$!
  for _ in $(seq 300); do
    as_unit_user /usr/local/bin/kvd health --runtime-dir "$rdir" --timeout 0.5 >/dev/null 2>&1 && return 0
    kill -0 "$DAEMON_PID" 2>/dev/null || { wait "$DAEMON_PID" || true; echo "the unit's ExecStart exited" >&2; return 1; }
    sleep 0.1
  done
  echo "the unit's ExecStart did not serve within 30 s" >&2
  return 1
}

systemctl() {
  case "$1" in
    daemon-reload) ;;
    enable) [ "$2" = --now ] && [ "$3" = kvd ] && unit_start ;;
    status) as_unit_user /usr/local/bin/kvd health --runtime-dir "/run/$(unit_get RuntimeDirectory)" ;;
    *) echo "systemctl $*: not emulated" >&2; return 1 ;;
  esac
}

unit_stop() {
  local rc=0
  kill -TERM "$DAEMON_PID"
  wait "$DAEMON_PID" || rc=$?
  [ "$rc" -eq 0 ] || { echo "the daemon exited with $rc on SIGTERM" >&2; return 1; }
  as_unit_user /usr/local/bin/kvd drop-tier --config /etc/kvd/kvd.toml --runtime-dir "/run/$(unit_get RuntimeDirectory)"
}

unit_checks() {
  local doc out
  doc=$(unit_get Documentation)
  [ -f "${doc#file://}" ] || { echo "Documentation=$doc: no such file after the install steps" >&2; return 1; }
  if command -v systemd-analyze >/dev/null; then
    out=$(systemd-analyze verify "$UNIT" 2>&1 || echo "VERIFY-FAILED")
    if echo "$out" | grep -q -e "VERIFY-FAILED" -e "kvd.service:"; then
      echo "$out" >&2; echo "systemd-analyze verify of the installed unit failed" >&2; return 1
    fi
  fi
}
