#!/usr/bin/env bash
# Daemon settings compared through the pipelined GPU bench, every run's ratio kept:
#
#   VARIANTS='new|;off|KVD_WARM_RESTART=0' ROUNDS=5 OUT=/tmp/ab bash tools/ab_runs.sh \
#     --pipeline 4 --clients 2 --repeat 5 --gpu-page-sizes 16 --gpu-pool block-outer ...
#
# VARIANTS: "label|ENV=V ENV2=V2" entries separated by ';' (an empty env: the defaults;
# labels of letters, digits, '_' and '.'), optionally "label|ENVS|--more --flags": bench
# flags of that variant alone, after the common ones (e.g. a bigger
# --gpu-host-capacity). Each of ROUNDS (default 5) rounds runs every
# variant once, in turn (each round starting with the next variant, so none always runs
# first or last), as `python3 -m kvd bench --gpu <the flags> --json
# $OUT/<label>-<round>.json` with that variant's environment (the daemon's knobs:
# KVD_<KNOB>), so a machine's slow spells fall on every variant alike. Then
# tools/ratio_runs.py pools each variant's runs and compares the others with the first
# (median difference, 90% bootstrap interval). DAEMON_LOG=1 also keeps each run's
# daemon debug log ($OUT/<label>-<round>.daemon.log) and prints the run's pipelined
# table and the daemon's per-copy timings and phases (tools/daemon_timings.py
# --phases): where a setting's copies wait. RUN_TIMEOUT (default 590 s) bounds each
# run. TREE=DIR (no spaces; relative to the repository) among a variant's environment
# runs that variant from another copy of kvd (e.g. `git worktree add DIR <commit>`:
# the code before a change against this tree's), with DIR's kvd and kvd_client first
# on PYTHONPATH. Runs on a machine with a CUDA GPU:
#   VARIANTS=... bash tools/ab_runs.sh <flags>
set -uo pipefail
cd "$(dirname "$0")/.."
: "${VARIANTS:?set VARIANTS, e.g. VARIANTS='new|;off|KVD_WARM_RESTART=0'}"
ROUNDS=${ROUNDS:-5}
RUN_TIMEOUT=${RUN_TIMEOUT:-590}
DAEMON_LOG=${DAEMON_LOG:-0}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)  # runs of a TREE variant start elsewhere
IFS=';' read -ra variants <<< "$VARIANTS"
for v in "${variants[@]}"; do
  label=${v%%|*}
  if ! [[ $label =~ ^[A-Za-z0-9_.]+$ ]]; then
    echo "ab_runs: bad label '$label' in VARIANTS" >&2
    exit 2
  fi
done
rc=0
n=${#variants[@]}
for r in $(seq 1 "$ROUNDS"); do
  for k in $(seq 0 $((n - 1))); do
    v=${variants[$(((k + r - 1) % n))]}  # each round starts one variant later
    label=${v%%|*}
    envs="" flags=""
    [[ $v == *"|"* ]] && envs=${v#*|}
    [[ $envs == *"|"* ]] && { flags=${envs#*|}; envs=${envs%%|*}; }
    run="$OUT/$label-$r"
    log_args=()
    [ "$DAEMON_LOG" = 1 ] && log_args=(--daemon-log "$run.daemon.log")
    echo "== round $r/$ROUNDS: $label ${envs:-(defaults)} $flags"
    tree=$PWD path=${PYTHONPATH:-}
    for word in $envs; do
      if [[ $word == TREE=* ]]; then
        tree=$(cd "${word#TREE=}" && pwd) || exit 2
        path="$tree/clients:$tree${PYTHONPATH:+:$PYTHONPATH}"
      fi
    done
    # shellcheck disable=SC2086  # envs is a list of ENV=V words, flags of bench flags
    if ! (cd "$tree" && env PYTHONPATH="$path" $envs timeout "$RUN_TIMEOUT" python3 -m kvd \
        bench --gpu "$@" $flags ${log_args[@]+"${log_args[@]}"} --json "$run.json" \
        > "$run.log" 2>&1); then
      echo "failed (log: $run.log):"
      tail -n 5 "$run.log"
      rc=1
    elif [ "$DAEMON_LOG" = 1 ]; then
      sed -n '/^pipelined/,$p' "$run.log"
      python3 tools/daemon_timings.py "$run.daemon.log" --phases | sed -n '/^daemon-side/,$p'
    fi
  done
done
python3 tools/ratio_runs.py "$OUT" --base "${variants[0]%%|*}" || rc=1
exit $rc
