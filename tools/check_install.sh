#!/usr/bin/env bash
# Build kvd's wheel and install it into a fresh venv (not editable), then start the
# daemon, read stats and health, and stop it: what the README's install lines give a user.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
tmp=$(mktemp -d /tmp/kvd-install-XXXXXX)
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
"$PYTHON" -m venv "$tmp/venv"
# The README's lines ("Installing it elsewhere"): a wheel of the checkout, installed by its path
# with an extra; the distribution is kvd-cache, never PyPI's unrelated "kvd".
"$PYTHON" -m pip wheel -q --no-deps -w "$tmp/dist" . 2>&1 | grep -v "^WARNING: Location" || true
wheel=$(ls "$tmp"/dist/kvd_cache-*-py3-none-any.whl)
"$tmp/venv/bin/python" -m pip install -q "$wheel[metrics]" 2>&1 | grep -v "^WARNING: Location" || true
"$tmp/venv/bin/python" -m pip show kvd-cache | grep "^Name: kvd-cache$" >/dev/null
if "$tmp/venv/bin/python" -m pip show kvd >/dev/null 2>&1; then
  echo "check_install: a distribution named kvd got installed" >&2; exit 1
fi
(cd "$tmp" && "$tmp/venv/bin/python" -c "import prometheus_client")  # the extra came along
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
