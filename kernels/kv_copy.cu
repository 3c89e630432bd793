// kv_copy.cu: byte copies between an engine's paged KV pool and canonical
// chunk bytes (kvd canonical format, see kvd/layout.py).
//
// Two kernels, dtype-agnostic (they move bytes):
//   kv_gather:  pool rows  -> canonical chunk shards
//   kv_scatter: canonical chunk shards -> pool rows
// A row may be split into `heads` pieces at head_stride apart in the pool
// (kvd_protocol/layout.py); the kernels copy pieces, so "row" below means
// one (token, head) piece of row_bytes/heads bytes.
// The canonical side is usually pinned host memory written or read directly
// through unified addressing (zero-copy), but any device-accessible address
// works (a device staging buffer, too).
//
// Arguments (identical for both kernels):
//   plane_bases   device array, num_layers*planes absolute device addresses,
//                 layer-major: plane_bases[layer*planes + plane]
//   page_ids      device array, n_chunks*ppc page ids, ppc = chunk_tokens/page_size;
//                 chunk c's token i lives in page page_ids[c*ppc + i/page_size],
//                 slot i % page_size. The caller validates the ids; a negative
//                 id (kvd's SKIP_PAGE, scatter only) copies nothing of its page
//   chunk_ptrs    device array, n_chunks device-accessible addresses, each the
//                 start of one chunk shard's canonical bytes
//                 [layer][plane][token][row_bytes] for ALL num_layers layers
//   n_chunks, num_layers, planes
//   layer_begin, layer_end   copy only layers [layer_begin, layer_end); the
//                 canonical offsets still use the full layer index
//   chunk_tokens, page_size
//   page_stride, token_stride, row_bytes   in bytes
//   heads, head_stride   a token row is `heads` pieces of piece_bytes =
//                 row_bytes/heads bytes, piece h at h*head_stride from the
//                 token's address (heads = 1: one contiguous row; the host
//                 checks that heads divides row_bytes)
//   vec_bytes     access width: 16, 8, 4, 2 or 1. The host picks the largest
//                 one dividing piece_bytes, the three strides, every plane base
//                 and every chunk pointer (any other value copies nothing)
//   cancel, cancel_seq   a load's cancel word in a flag page (host-mapped
//                 memory the engine's CPU writes) or null: a block that
//                 finds *cancel == cancel_seq when it starts copies nothing,
//                 so once the engine cancelled a load, no kernel that has not
//                 started yet writes its pages
//
// Piece h of token row t of page p of plane (l, k) is the piece_bytes at
//   plane_bases[l*planes + k] + p*page_stride + t*token_stride + h*head_stride
// and, for token i of chunk c, at canonical byte
//   chunk_ptrs[c] + (((l*planes + k)*chunk_tokens + i)*heads + h)*piece_bytes.
//
// Work split: a group of g threads copies one piece (g = the smallest power
// of two >= piece_bytes/vec_bytes, at most 32), each thread keeping up to
// KV_UNROLL loads in flight before its stores. Loads and stores are
// streaming (.cs): the bytes are touched once and should not push the
// engine's data out of L2. Pieces are numbered [chunk][layer][plane][token]
// [head], so neighbouring groups write (or read) neighbouring canonical bytes. A
// grid-stride loop lets the host cap the grid, so copies leave the engine
// most of its SMs. The host keeps
// n_chunks*(layer_end-layer_begin)*planes*chunk_tokens*heads below 2^31 and
// blockDim.x a multiple of 32.

#ifndef KV_UNROLL
#define KV_UNROLL 4
#endif

template <typename V, bool GATHER>
__device__ __forceinline__ void kv_copy_rows(
    const unsigned long long* __restrict__ plane_bases,
    const long long* __restrict__ page_ids,
    const unsigned long long* __restrict__ chunk_ptrs,
    int n_chunks, int planes, int layer_begin, int layer_end,
    int chunk_tokens, int page_size,
    long long page_stride, long long token_stride, long long row_bytes,
    int heads, long long head_stride)
{
    const long long piece_bytes = row_bytes / heads;
    const unsigned vecs = (unsigned)(piece_bytes / (long long)sizeof(V));
    unsigned g = 1;
    while (g < vecs && g < 32u) g <<= 1;
    const unsigned tid = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned lane = tid & (g - 1u);
    const unsigned n_groups = (gridDim.x * blockDim.x) / g;

    const unsigned uplanes = (unsigned)planes;
    const unsigned utokens = (unsigned)chunk_tokens;
    const unsigned upage = (unsigned)page_size;
    const unsigned uheads = (unsigned)heads;
    const unsigned ppc = utokens / upage;
    const unsigned pieces_per_plane = utokens * uheads;
    const unsigned rows_per_chunk = (unsigned)(layer_end - layer_begin) * uplanes * pieces_per_plane;
    const unsigned total = (unsigned)n_chunks * rows_per_chunk;

    for (unsigned r = tid / g; r < total; r += n_groups) {
        const unsigned c = r / rows_per_chunk;
        const unsigned rem = r - c * rows_per_chunk;
        const unsigned lp = rem / pieces_per_plane;   // (layer - layer_begin)*planes + plane
        const unsigned th = rem - lp * pieces_per_plane;  // token*heads + head
        const unsigned i = uheads == 1u ? th : th / uheads;  // token within the chunk
        const unsigned h = th - i * uheads;
        const unsigned plane_idx = (unsigned)layer_begin * uplanes + lp;  // layer*planes + plane
        const unsigned slot = i / upage;
        const unsigned t = i - slot * upage;

        const long long page = __ldg(page_ids + (unsigned long long)c * ppc + slot);
        if (page < 0) continue;  // a scatter's skipped page: a partial load's tail
        const unsigned long long pool_addr = __ldg(plane_bases + plane_idx)
            + (unsigned long long)(page * page_stride + (long long)t * token_stride
                                   + (long long)h * head_stride);
        const unsigned long long canon_addr = __ldg(chunk_ptrs + c)
            + ((unsigned long long)plane_idx * pieces_per_plane + th)
              * (unsigned long long)piece_bytes;

        const V* src = reinterpret_cast<const V*>(GATHER ? pool_addr : canon_addr);
        V* dst = reinterpret_cast<V*>(GATHER ? canon_addr : pool_addr);

        for (unsigned j = lane; j < vecs; j += g * KV_UNROLL) {
            V tmp[KV_UNROLL];
#pragma unroll
            for (int u = 0; u < KV_UNROLL; ++u) {
                const unsigned k = j + (unsigned)u * g;
                if (k < vecs) tmp[u] = __ldcs(src + k);
            }
#pragma unroll
            for (int u = 0; u < KV_UNROLL; ++u) {
                const unsigned k = j + (unsigned)u * g;
                if (k < vecs) __stcs(dst + k, tmp[u]);
            }
        }
    }
}

__device__ __forceinline__ bool kv_cancelled(const volatile unsigned int* cancel,
                                              unsigned int cancel_seq)
{
    __shared__ int skip;
    if (threadIdx.x == 0) skip = cancel != nullptr && *cancel == cancel_seq;
    __syncthreads();
    return skip != 0;
}

template <bool GATHER>
__device__ __forceinline__ void kv_copy_dispatch(
    const unsigned long long* __restrict__ plane_bases,
    const long long* __restrict__ page_ids,
    const unsigned long long* __restrict__ chunk_ptrs,
    int n_chunks, int planes, int layer_begin, int layer_end,
    int chunk_tokens, int page_size,
    long long page_stride, long long token_stride, long long row_bytes,
    int heads, long long head_stride, int vec_bytes)
{
    switch (vec_bytes) {
    case 16:
        kv_copy_rows<uint4, GATHER>(plane_bases, page_ids, chunk_ptrs, n_chunks, planes,
            layer_begin, layer_end, chunk_tokens, page_size, page_stride, token_stride, row_bytes,
            heads, head_stride);
        break;
    case 8:
        kv_copy_rows<uint2, GATHER>(plane_bases, page_ids, chunk_ptrs, n_chunks, planes,
            layer_begin, layer_end, chunk_tokens, page_size, page_stride, token_stride, row_bytes,
            heads, head_stride);
        break;
    case 4:
        kv_copy_rows<unsigned int, GATHER>(plane_bases, page_ids, chunk_ptrs, n_chunks, planes,
            layer_begin, layer_end, chunk_tokens, page_size, page_stride, token_stride, row_bytes,
            heads, head_stride);
        break;
    case 2:
        kv_copy_rows<unsigned short, GATHER>(plane_bases, page_ids, chunk_ptrs, n_chunks, planes,
            layer_begin, layer_end, chunk_tokens, page_size, page_stride, token_stride, row_bytes,
            heads, head_stride);
        break;
    case 1:
        kv_copy_rows<unsigned char, GATHER>(plane_bases, page_ids, chunk_ptrs, n_chunks, planes,
            layer_begin, layer_end, chunk_tokens, page_size, page_stride, token_stride, row_bytes,
            heads, head_stride);
        break;
    default:
        break;
    }
}

extern "C" __global__ void kv_gather(
    const unsigned long long* __restrict__ plane_bases,
    const long long* __restrict__ page_ids,
    const unsigned long long* __restrict__ chunk_ptrs,
    int n_chunks, int num_layers, int planes, int layer_begin, int layer_end,
    int chunk_tokens, int page_size,
    long long page_stride, long long token_stride, long long row_bytes,
    int heads, long long head_stride, int vec_bytes,
    const volatile unsigned int* cancel, unsigned int cancel_seq)
{
    if (kv_cancelled(cancel, cancel_seq)) return;
    (void)num_layers;  // canonical offsets need only layer*planes; kept for a uniform signature
    kv_copy_dispatch<true>(plane_bases, page_ids, chunk_ptrs, n_chunks, planes, layer_begin,
        layer_end, chunk_tokens, page_size, page_stride, token_stride, row_bytes, heads,
        head_stride, vec_bytes);
}

extern "C" __global__ void kv_scatter(
    const unsigned long long* __restrict__ plane_bases,
    const long long* __restrict__ page_ids,
    const unsigned long long* __restrict__ chunk_ptrs,
    int n_chunks, int num_layers, int planes, int layer_begin, int layer_end,
    int chunk_tokens, int page_size,
    long long page_stride, long long token_stride, long long row_bytes,
    int heads, long long head_stride, int vec_bytes,
    const volatile unsigned int* cancel, unsigned int cancel_seq)
{
    if (kv_cancelled(cancel, cancel_seq)) return;
    (void)num_layers;
    kv_copy_dispatch<false>(plane_bases, page_ids, chunk_ptrs, n_chunks, planes, layer_begin,
        layer_end, chunk_tokens, page_size, page_stride, token_stride, row_bytes, heads,
        head_stride, vec_bytes);
}
