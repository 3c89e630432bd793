#!/usr/bin/env bash
# GPU machine: unpacks one piece of the vLLM 0.34 staging (tools/gpu/stage_vllm034.sh) into
# /tmp/v034site. A copy of this script rides in each piece dir; run them in order, one run each,
# every run within 30 s of the previous one's end (the machine and its /tmp go back after that):
#
#   run k, carrying [".v034stage/pieces/KK"]:  bash .v034stage/pieces/KK/v034_piece.sh
#
# Piece 01 starts afresh. A later piece exits 42 saying MACHINE LOST when piece 01's files are
# gone (start again at 01), 2 when the piece before it was not unpacked. Files cut into parts
# (name.v034part-III-of-NNN) are joined as soon as all their parts are in. The last piece
# checks the file count and bytes against manifest.txt, then imports torch and vllm; after
# it, in the same run or the next: bash tools/gpu/v034_run.sh python3 your_script.py
set -u
SECONDS=0
here=$(cd "$(dirname "$0")" && pwd)
k=$(basename "$here") D=/tmp/v034site
M=$D/.v034
n=$(awk '$1 == "pieces" {print $2}' "$here/manifest.txt")
prev=$(printf %02d $((10#$k - 1)))
if [ "$k" = 01 ]; then rm -rf "$D"; mkdir -p "$M"
elif [ ! -f "$M/done-01" ]; then echo "MACHINE LOST: $D is gone; run piece 01 again, then the others at once"; exit 42
elif [ ! -f "$M/done-$prev" ]; then echo "piece $prev was not unpacked: run it first"; exit 2; fi

# unpack (multi-stream .tar.xz: GNU tar through xz, or Python's tarfile); a piece run again is not
if [ -f "$M/done-$k" ]; then echo "piece $k was unpacked before: not again"; else
  if command -v xz >/dev/null; then xz -dc -T0 "$here/piece.tar.xz" | tar -x -C "$D" || exit 1
  else python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$here/piece.tar.xz" "$D" || exit 1; fi

  # join files cut into parts once every part is there
  find "$D" -name '*.v034part-*-of-*' | sed 's/\.v034part-[0-9]*-of-\([0-9]*\)$/\t\1/' | sort -u |
  while IFS=$'\t' read -r base of; do
    parts=("$base".v034part-*-of-"$of")
    [ "${#parts[@]}" -eq $((10#$of)) ] || continue
    cat "${parts[@]}" > "$base.v034join" && chmod --reference="${parts[0]}" "$base.v034join" &&
      mv "$base.v034join" "$base" && rm -f "${parts[@]}" && echo "joined ${base#$D/} from $of parts"
  done
  touch "$M/done-$k"
fi
count() {  # %.0f: mawk prints a sum over 2^31 as 2.35e+09 with print, clamps it to 2^31-1 with %d
  find "$D" -path "$M" -prune -o \( -type f -o -type l \) -printf '%s\n' | awk '{n++; b+=$1} END{printf "%d %.0f\n", n, b}'; }
read -r files bytes < <(count)
echo "piece $k/$n unpacked: $(stat -c %s "$here/piece.tar.xz") bytes carried, $D now $files files," \
     "$((bytes / 1000000)) MB, $SECONDS s"
[ "$((10#$k))" -lt "$n" ] && exit 0

# last piece: complete? then import
want_files=$(awk '$1 == "files" {print $2}' "$here/manifest.txt")
want_bytes=$(awk '$1 == "bytes" {print $2}' "$here/manifest.txt")
if [ "$files" != "$want_files" ] || [ "$bytes" != "$want_bytes" ]; then
  echo "INCOMPLETE: $files files / $bytes bytes, manifest says $want_files / $want_bytes"
  find "$D" -name '*.v034part-*' | head; exit 1
fi
echo "complete: $files files, $bytes bytes, as the manifest says"
touch "$M/complete"
PYTHONPATH=$D${PYTHONPATH:+:$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 python3 -c '
import time; t = time.time()
import torch, vllm
from vllm.vllm_flash_attn.flash_attn_interface import FA3_AVAILABLE, FA3_UNAVAILABLE_REASON
import vllm._C_stable_libtorch
print("vllm", vllm.__version__, vllm.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())
# (no torch.backends.cudnn.version(): torch 2.14.1 is built on cuDNN 9.24 and refuses 9.19, the image one)
print("gpu", torch.cuda.is_available() and torch.cuda.get_device_name(0), "| FA3", FA3_AVAILABLE,
      FA3_UNAVAILABLE_REASON or "", "| import %.1f s" % (time.time() - t))
' || { echo "IMPORT FAILED"; exit 1; }
echo "done in $SECONDS s"
