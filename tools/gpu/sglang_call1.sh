#!/usr/bin/env bash
# GPU machine: unpacks the staged SGLang parts carried beside this script into
# /tmp/sgsite (tools/gpu/stage_sglang.sh made them). Alone it is a run of its own
# (carry [".sgstage/curK"]: bash .sgstage/curK/call1.sh), quick on purpose: the next
# run must reach the same machine within ~30 s of this one's end. call2.sh calls it
# first. Whole archives (part*.tar.xz) are unpacked; pieces of a split one
# (part*.tar.xz.KofN) wait in /tmp/sgsite/.pieces until all N are there, then are
# joined and unpacked.
set -u
SECONDS=0
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/sgsite/.pieces
unpack() {  # an xz tar stream on stdin
  if command -v xz >/dev/null; then xz -dc -T0 | tar -x -C /tmp/sgsite
  else python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/sgsite')"; fi
}
for part in "$here"/part*.tar.xz; do
  [ -f "$part" ] && unpack < "$part" && echo "unpacked $(basename "$part") ($SECONDS s)"
done
for piece in "$here"/part*.tar.xz.*of*; do
  [ -f "$piece" ] && cp "$piece" /tmp/sgsite/.pieces/ && echo "kept $(basename "$piece")"
done
for first in /tmp/sgsite/.pieces/*.1of*; do
  [ -f "$first" ] || continue
  base=${first%.1of*}; n=${first##*of}; pieces=()
  for k in $(seq 1 "$n"); do pieces+=("$base.${k}of$n"); done
  ls "${pieces[@]}" >/dev/null 2>&1 || continue
  cat "${pieces[@]}" | unpack && rm -f "${pieces[@]}" && echo "joined and unpacked $(basename "$base") ($SECONDS s)"
done
echo "/tmp/sgsite: $(du -sh /tmp/sgsite | cut -f1), parts: $(ls /tmp/sgsite/.sgparts 2>/dev/null | tr '\n' ' ')"
