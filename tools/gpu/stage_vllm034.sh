#!/usr/bin/env bash
# Stage vLLM 0.34.0 (CUDA 13 wheel) for the GPU machine (torch 2.11 image, no network, < ~60 MB
# carried per run). Ships torch 2.14.1 with its nccl 2.30.7 and triton 3.8, torchvision 0.29.1,
# transformers 5.22.2, huggingface_hub 2.4 (the image's are too old), every other missing
# requirement (../shared/gpu/vllm/resolve_deps.py walks them) and CuTe DSL 4.8.0 (nvidia-cutlass-dsl,
# cu13 flavor) + quack-kernels 0.6.5, which kernel warmup imports on every CUDA engine start; prunes
# what Llama + FlashAttention 3 on Hopper never loads; cuts the site dir into numbered xz tar pieces
# < 58 MB that each unpack alone (big files go in 32 MiB parts, joined on the device by
# tools/gpu/v034_piece.sh): 16 pieces, 888.5 MB, 20592 files / 2.35 GB unpacked (2026-12-05).
#
#   bash tools/gpu/stage_vllm034.sh              # here, in the project root (~20 min, 2 cores)
#   bash tools/gpu/stage_vllm034.sh --preflight  # again only the CPU import check of the site
#
# Result (git-ignored through .git/info/exclude): .v034stage/pieces/01 .. NN, each holding
# piece.tar.xz, manifest.txt and v034_piece.sh. On the GPU machine, one run per piece, in
# order, each within 30 s of the previous run's end (else /tmp is gone: start again at 01):
#   run k, carrying [".v034stage/pieces/KK"]:  bash .v034stage/pieces/KK/v034_piece.sh
# The last piece checks the manifest and imports torch and vllm. Then, in the same run or the
# next one:  bash tools/gpu/v034_run.sh python3 tools/your_script.py
# Env: GPUPY (a Python 3.12 like the GPU image, default /work/gpuimg/bin/python), TORCH, TV.
# Not shipped: cuDNN 9.24 (torch 2.14.1's; 553 MB): torch.backends.cudnn refuses the image's 9.19;
# the rest of SKIP below (tilelang, flashinfer, cudnn-frontend, tokenspeed-mla, humming, torchcodec,
# PyNvVideoCodec, fastsafetensors, instanttensor, nvtx): the Llama + FA3 engine start imports none of
# them unguarded, given VLLM_USE_FLASHINFER_SAMPLER=0 (v034_run.sh sets it). SKIP's cutlass-dsl,
# quack-kernels and apache-tvm-ffi ship, as pinned downloads below, not through the resolver.
set -euo pipefail
repo=$(git rev-parse --show-toplevel); cd "$repo"
here=$(cd "$(dirname "$0")" && pwd)
GPUPY=${GPUPY:-/work/gpuimg/bin/python}
RESOLVE=${RESOLVE:-$repo/../shared/gpu/vllm/resolve_deps.py}
TORCH=${TORCH:-2.14.1} TV=${TV:-0.29.1}   # vLLM pins torch==2.14.0/torchvision==0.29.0: same ABI
CUTOFF=${CUTOFF:-2026-11-20T00:00:00Z}    # vLLM 0.34.0 was uploaded 2026-11-16
S=.v034stage SITE=.v034stage/site
PIP=(download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
     --platform manylinux_2_18_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
dl() { "$S/pip26/bin/python" -m pip "${PIP[@]}" "$@" 2> >(grep -v 'is ignored' >&2); }

preflight() {  # import check on this CPU machine, with the GPU image's Python and a libcuda stub
  bash "$here/cuda_stub.sh" $S/cudastub $SITE/vllm
  LD_LIBRARY_PATH=$S/cudastub PYTHONPATH=$SITE:$repo/clients:$repo:$S/cpufill/site \
    "$GPUPY" - "$SITE" <<'EOF'
import glob, importlib, importlib.metadata, os, sys, traceback
site, bad = sys.argv[1], 0
mods = ["torch", "vllm", "triton", "torchvision.ops", "transformers", "huggingface_hub", "xgrammar",
        "vllm._custom_ops", "vllm.vllm_flash_attn.flash_attn_interface", "vllm.v1.attention.backends.flash_attn",
        "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu.model_runner", "vllm.v1.engine.core",
        "vllm.entrypoints.llm", "kvd_client.vllm",
        # engine start past the model: kernel warmup and what it imports inside its functions on
        # CUDA (minimax_m3_msa_warmup -> cutlass + quack), sampler, KV connector base, llama
        "cutlass", "cutlass.cute", "quack", "quack.compile_utils", "cuda.bindings.driver",
        "vllm.model_executor.warmup.kernel_warmup", "vllm.model_executor.warmup.minimax_m3_msa_warmup",
        "vllm.model_executor.warmup.step5_dsa_warmup", "vllm.model_executor.warmup.jit_warmup_triton_helper",
        "vllm.model_executor.kernels.linear.cute_dsl.ll_bf16",
        "vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm_plans",
        "vllm.v1.worker.extensible_kv_cache", "vllm.v1.worker.gpu.sample.sampler",
        "vllm.distributed.kv_transfer.kv_connector.v1.base", "vllm.model_executor.models.llama"]
mods += sorted(p[len(site) + 1:].split(".")[0].replace("/", ".")        # every vllm extension
               for p in glob.glob(site + "/vllm/**/*.so", recursive=True))
for m in mods:
    try:
        mod = importlib.import_module(m)
        print(f"ok   {m} {getattr(mod, '__version__', '')} {getattr(mod, '__file__', '')}")
    except BaseException as e:  # noqa: BLE001 - report everything, judge below
        msg = f"{type(e).__name__}: {e}"
        fatal = isinstance(e, ModuleNotFoundError) or "undefined symbol" in msg or site not in str(
            getattr(sys.modules.get(m.split(".")[0]), "__file__", site))
        bad += fatal
        print(f"{'FAIL' if fatal else 'gpu?'} {m}: {msg[:300]}")
        if fatal:
            traceback.print_exc(limit=-3)
try:  # what kv_connector_module_path "kvd_client.vllm" loads
    from kvd_client.vllm import KvdConnector
    print("ok   KvdConnector, a", KvdConnector.__mro__[1].__name__)
except Exception as e:  # noqa: BLE001
    bad += 1; print(f"FAIL KvdConnector: {type(e).__name__}: {e}")
try:  # CuTe DSL reached through the site's `cutlass` link (no .pth on PYTHONPATH): the cu13 IR module
    import importlib.util as iu  # loaded, its runtime library found, vLLM's own probe says available
    from cutlass._mlir._mlir_libs import _cutlass_ir
    from cutlass.base_dsl.env_manager import get_prefix_dsl_libs
    from vllm.model_executor.kernels.linear.cute_dsl.ll_bf16 import is_available
    libs, spec = get_prefix_dsl_libs("CUTE_DSL"), iu.find_spec("quack")
    assert ".cu13." in _cutlass_ir.__file__ and site in _cutlass_ir.__file__, _cutlass_ir.__file__
    assert libs and "cu13/lib/libcute_dsl_runtime.so" in libs and os.path.exists(libs), libs
    assert spec and site in spec.origin and is_available(), (spec, is_available())
    print("ok   CuTe DSL", importlib.metadata.version("nvidia-cutlass-dsl"), "runtime", libs.split("/site/")[-1],
          "| quack", importlib.metadata.version("quack-kernels"))
except Exception as e:  # noqa: BLE001
    bad += 1; print(f"FAIL CuTe DSL: {type(e).__name__}: {e}")
import torch, vllm.vllm_flash_attn.flash_attn_interface as fa
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(),
      "| FA3", fa.FA3_AVAILABLE, fa.FA3_UNAVAILABLE_REASON or "")
print("PREFLIGHT", "FAILED" if bad else "PASSED", f"({bad} fatal)")
sys.exit(1 if bad else 0)
EOF
}
[ "${1:-}" = --preflight ] && { preflight; exit; }

grep -qxF '/.v034stage/' .git/info/exclude 2>/dev/null || echo '/.v034stage/' >> .git/info/exclude
mkdir -p $S/whl $S/over $S/cute $S/cpufill
[ -x $S/pip26/bin/python ] || { "$GPUPY" -m venv $S/pip26 && $S/pip26/bin/python -m pip install -q 'pip>=26'; }

# 1. vLLM, then its missing requirements (no extras; DEVICE in resolve_deps.py = the image)
dl -d $S/whl vllm==0.34.0
unzip -p $S/whl/vllm-0.34.0-*.whl '*/METADATA' | grep -E '^Requires-Dist: (torch|triton|huggingface)'
SKIP=tilelang,nvidia-cutlass-dsl,quack-kernels,tokenspeed-mla,humming-kernels,pynvvideocodec,torchcodec
SKIP=$SKIP,fastsafetensors,instanttensor,nvidia-cudnn-frontend,flashinfer-python,nvtx,apache-tvm-ffi
rm -rf $S/deps && mkdir -p $S/deps
python3 "$RESOLVE" $S/deps $S/whl/vllm-0.34.0-*.whl --pip $S/pip26/bin/python --prior-to "$CUTOFF" \
  --skip "$SKIP" > $S/deps/resolve.txt 2> >(grep -v 'is ignored' >&2)

# 2. named in the image but too old there (torch 2.11 + nccl 2.28, triton 3.6, torchvision 0.26
#    = torch 2.11's, hub 1.33 + transformers 5.17 which wants hub < 2); tvm-ffi: xgrammar needs it
# (to change TORCH or TV: rm -rf .v034stage/over first)
dl -d $S/over torch==$TORCH torchvision==$TV transformers==5.22.2 huggingface_hub==2.4.0 apache-tvm-ffi==0.1.11
dl -d $S/over $(unzip -p $S/over/torch-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: \(\(triton\|nvidia-nccl\)[^;]*\).*/\1/p')
# CuTe DSL (`cutlass`) and QuACK (`quack`): kernel_warmup imports minimax_m3_msa_warmup on every CUDA
# start, and its chain (vllm/models/minimax_m3/nvidia/ops/index_decode_score.py) imports both at
# module level. vLLM pins nvidia-cutlass-dsl[cu13]==4.8.0 = the wrapper + libs-base + libs-core +
# libs-cu13 (libs-cu12, a plain requirement of the wrapper, is the CUDA 12 flavor: not shipped);
# quack-kernels==0.6.5 (its torch-c-dlpack-ext is not needed: torch 2.14 has the DLPack exchange
# API itself; its apache-tvm-ffi ships above, cuda-bindings is the image's 13.5)
dl -d $S/cute nvidia-cutlass-dsl==4.8.0 nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0 \
  nvidia-cutlass-dsl-libs-cu13==4.8.0 quack-kernels==0.6.5
dl -d $S/cpufill six ninja opencv-python-headless  # the image has these, the CPU copy of it not
"$GPUPY" -m pip install -q --no-index --no-deps --upgrade --target $S/cpufill/site $S/cpufill/*.whl

# 3. every requirement of what ships, against what ships plus the image (a report, not a stop)
"$GPUPY" - $S/deps/*.whl $S/over/*.whl $S/cute/*.whl $S/whl/vllm-0.34.0-*.whl <<'EOF' | tee $S/reqcheck.txt
import importlib.metadata as md, sys, zipfile
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as cn
ship = {cn(w.split("/")[-1].split("-")[0]): w.split("/")[-1].split("-")[1] for w in sys.argv[1:]}
image = {cn(d.metadata["Name"]): d.version for d in md.distributions()}
for w in sys.argv[1:]:
    meta = zipfile.ZipFile(w).read(next(n for n in zipfile.ZipFile(w).namelist() if n.endswith("METADATA")))
    for line in meta.decode().splitlines():
        if not line.startswith("Requires-Dist:"): continue
        r = Requirement(line.split(":", 1)[1])
        if r.marker and not r.marker.evaluate({"extra": ""}): continue
        v, where = (ship[cn(r.name)], "ship") if cn(r.name) in ship else (image.get(cn(r.name)), "image")
        if v is None or not r.specifier.contains(v, prereleases=True):
            print(f"{w.split('/')[-1].split('-')[0]:24s} wants {str(r):44s} {where}: {v or 'MISSING'}")
EOF

# 4. one site dir, then prune what Llama + FA3 on Hopper never loads
rm -rf $SITE
"$GPUPY" -m pip install -q --no-index --no-deps --no-compile --target $SITE $S/deps/*.whl $S/over/*.whl $S/cute/*.whl \
  $S/whl/vllm-0.34.0-*.whl 2>&1 | grep -v 'is ignored' || true
prune() { for p in "$@"; do if [ -e $SITE/$p ]; then echo "prune $(du -sh $SITE/$p | cut -f1) $p"; rm -rf $SITE/$p
          else echo "prune: not there: $p"; fi; done; }
prune vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
  vllm/third_party/deep_gemm/_C_extension.abi3.so vllm/third_party/deep_gemm/include \
  vllm/third_party/fmha_sm100/cutlass vllm/_flashmla_C.abi3.so vllm/_flashmla_extension_C.abi3.so \
  vllm/_flashkda_C.abi3.so vllm/_deepselect_C.abi3.so xgrammar/lib/libxgrammar.a \
  torch/include torch/bin/protoc torch/bin/protoc-3.21.12.0 \
  triton/backends/nvidia/bin/ptxas-blackwell triton/backends/nvidia/lib/cupti-blackwell \
  triton/backends/nvidia/lib/cupti/libcupti_static.a triton/backends/nvidia/lib/cupti/libnvperf_host_static.a \
  nvidia_cutlass_dsl/dsl_packages/iket nvidia_cutlass_dsl/cu13/lib/stubs
# `cutlass` lives in nvidia_cutlass_dsl/dsl_packages, put on sys.path by nvidia_cutlass_dsl_packages.pth,
# which Python reads in site-packages only, never on PYTHONPATH (how v034_run.sh uses the site): a
# relative symlink puts it at the top (the DSL finds cu13/lib through Path.resolve(); the pieces carry it)
ln -sfn nvidia_cutlass_dsl/dsl_packages/cutlass $SITE/cutlass
find $SITE -name '*.so*' -type f | while read -r f; do  # debug info, where any was left
  readelf -S "$f" 2>/dev/null | grep -q '\.debug_info' && { echo "strip $f"; strip --strip-debug "$f"; } || true; done
du -sh $SITE

# 5. pieces and their manifest
rm -rf $S/pieces
python3 - $SITE $S/pieces 57900000 <<'EOF'
import io, lzma, multiprocessing as mp, os, stat, sys, tarfile  # cut SITE into pieces < LIMIT bytes
site, out, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
PART, SEG = 32 << 20, 8 << 20  # a file over 48 MiB goes in 32 MiB parts; small files in 8 MiB groups
files = sorted(os.path.relpath(os.path.join(d, f), site) for d, ds, fs in os.walk(site)  # os.walk puts a
               for f in fs + [x for x in ds if os.path.islink(os.path.join(d, x))])  # link to a dir in ds
segs, cur, size = [], [], 0
for rel in files:
    n = os.lstat(os.path.join(site, rel)).st_size
    if n > PART * 3 // 2:
        k = -(-n // PART)
        segs += [[(rel, f"{rel}.v034part-{i:03d}-of-{k:03d}", i * PART, PART)] for i in range(k)]
        continue
    if cur and size + n > SEG:
        segs.append(cur); cur, size = [], 0
    cur.append((rel, rel, 0, n)); size += n
segs.append(cur)

def pack(seg):  # tar members (no end marker) as one xz stream; streams concatenate into a .tar.xz
    buf = io.BytesIO()
    for rel, arc, off, n in seg:
        p, ti = os.path.join(site, rel), tarfile.TarInfo(arc)
        st = os.lstat(p); ti.mtime, ti.mode = int(st.st_mtime), st.st_mode & 0o7777
        data = b""
        if stat.S_ISLNK(st.st_mode):
            ti.type, ti.linkname = tarfile.SYMTYPE, os.readlink(p)
        else:
            with open(p, "rb") as f:
                f.seek(off); data = f.read(n)
            ti.size = len(data)
        buf.write(ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape") + data + bytes(-len(data) % 512))
    return lzma.compress(buf.getvalue(), preset=9)

with mp.Pool(os.cpu_count()) as pool:
    blobs = pool.map(pack, segs, chunksize=1)
end = lzma.compress(bytes(1024))
pieces = []  # first fit, biggest first
for b in sorted(blobs, key=len, reverse=True):
    assert len(b) + len(end) <= limit, "one segment over the limit"
    for pc in pieces:
        if sum(map(len, pc)) + len(b) + len(end) <= limit:
            pc.append(b); break
    else:
        pieces.append([b])
sizes = [os.lstat(os.path.join(site, r)).st_size for r in files]
for i, pc in enumerate(pieces, 1):
    os.makedirs(f"{out}/{i:02d}")
    with open(f"{out}/{i:02d}/piece.tar.xz", "wb") as f:
        f.write(b"".join(pc) + end)
    with open(f"{out}/{i:02d}/manifest.txt", "w") as f:
        f.write(f"pieces {len(pieces)}\nfiles {len(files)}\nbytes {sum(sizes)}\n")
print(f"{len(files)} files, {sum(sizes)} bytes -> {len(segs)} xz streams -> {len(pieces)} pieces")
EOF
for d in $S/pieces/*/; do cp "$here/v034_piece.sh" "$d"; done
ls -l $S/pieces/*/piece.tar.xz | awk '{n++; b+=$5; print $5, $9} END{printf "%d pieces, %.1f MB\n", n, b/1e6}'
echo "tree that travels besides a piece: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes tracked"
preflight
