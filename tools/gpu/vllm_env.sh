# Sourced by tools/gpu/v026_run.sh and v034_run.sh once their site $D is checked: this
# checkout and vLLM from $D importable, offline, and the settings every staged vLLM run needs.
export PYTHONPATH=$D:$PWD/clients:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# vLLM's sampler imports flashinfer unless this is 0; flashinfer is not staged.
export VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
