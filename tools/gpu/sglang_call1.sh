#!/usr/bin/env bash
# GPU machine: unpacks the staged SGLang parts carried beside this script into $SGSITE
# (stage.env beside it names it, else the environment; default /tmp/sgsite: SGLang 0.5.16 from
# tools/gpu/stage_sglang.sh; /tmp/sg023site: 0.5.23 from stage_sglang023.sh). Alone it is a run of its own
# (carry [".sgstage/curK"]: bash .sgstage/curK/call1.sh), quick on purpose: the next
# run must reach the same machine within ~30 s of this one's end. call2.sh calls it
# first. Whole archives (part*.tar.xz) are unpacked; pieces of a split one
# (part*.tar.xz.KofN) wait in "$SGSITE"/.pieces until all N are there, then are
# joined and unpacked.
set -u
SECONDS=0
here=$(cd "$(dirname "$0")" && pwd)
[ -f "$here/stage.env" ] && . "$here/stage.env"
SGSITE=${SGSITE:-/tmp/sgsite}
mkdir -p "$SGSITE/.pieces"
unpack() {  # an xz tar stream on stdin
  if command -v xz >/dev/null; then xz -dc -T0 | tar -x -C "$SGSITE"
  else python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1])" "$SGSITE"; fi
}
for part in "$here"/part*.tar.xz; do
  [ -f "$part" ] && unpack < "$part" && echo "unpacked $(basename "$part") ($SECONDS s)"
done
for piece in "$here"/part*.tar.xz.*of*; do
  [ -f "$piece" ] && cp "$piece" "$SGSITE"/.pieces/ && echo "kept $(basename "$piece")"
done
for first in "$SGSITE"/.pieces/*.1of*; do
  [ -f "$first" ] || continue
  base=${first%.1of*}; n=${first##*of}; pieces=()
  for k in $(seq 1 "$n"); do pieces+=("$base.${k}of$n"); done
  ls "${pieces[@]}" >/dev/null 2>&1 || continue
  cat "${pieces[@]}" | unpack && rm -f "${pieces[@]}" && echo "joined and unpacked $(basename "$base") ($SECONDS s)"
done
echo "$SGSITE: $(du -sh "$SGSITE" | cut -f1), parts: $(ls "$SGSITE/.sgparts" 2>/dev/null | tr '\n' ' ')"
