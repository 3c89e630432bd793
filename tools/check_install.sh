#!/usr/bin/env bash
# Build and install kvd into a fresh venv (not editable), then start the
# daemon, read stats and health, and stop it: what `pip install .` gives a user.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
tmp=$(mktemp -d /tmp/kvd-install-XXXXXX)
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
"$PYTHON" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q . 2>&1 | grep -v "^WARNING: Location" || true
"$tmp/venv/bin/kvd" --help >/dev/null
export KVD_RUNTIME_DIR="$tmp/run"
(cd "$tmp" && exec "$tmp/venv/bin/kvd" serve --host-capacity 16MiB --warm-restart false) >"$tmp/serve.log" 2>&1 &
pid=$!
for _ in $(seq 100); do "$tmp/venv/bin/kvd" health --timeout 0.5 >/dev/null 2>&1 && break; sleep 0.1; done
"$tmp/venv/bin/kvd" health
"$tmp/venv/bin/kvd" stats | head -2
(cd "$tmp" && "$tmp/venv/bin/python" -c "import kvd_client.vllm.settings; print('vLLM connector shipped (imports without vLLM)')")
(cd "$tmp" && "$tmp/venv/bin/python" -c "import kvd_client.sglang.options, kvd_client.sglang.chain; print('SGLang backend shipped (options and keys import without SGLang)')")
(cd "$tmp" && "$tmp/venv/bin/python" -c "import kvd_client, kvd.kernels, importlib.resources as r; \
  print('kernels shipped:', sorted(p.name for p in r.files('kvd.kernels').iterdir() if p.name.endswith('.cu'))); \
  from kvd.cuda.kernels import kernel_source_path; print('kernel source found at', kernel_source_path())")
kill -TERM "$pid"
wait "$pid"
pid=""
echo "check_install: clean install serves, answers stats and health, and stops with exit 0"
