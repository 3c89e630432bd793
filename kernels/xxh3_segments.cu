// Segment digests of disk chunk payloads on the GPU (kvd/chunk_digest.py).
//
// XXH3-64 (seed 0, default secret) of every segment, long-input path only:
// each segment is a multiple of 4096 bytes (so > 240) and 8-byte aligned.
// One group of 8 threads hashes one segment: thread `lane` owns XXH3
// accumulator `lane`, reads the 8 bytes of each 64-byte stripe at
// 8 * lane (the group's loads are one contiguous 64-byte access), and gets
// its neighbour's input word (XXH3 adds data[i] into acc[i ^ 1]) by a shuffle.
//
// Chunks lie at base + c * stride, each `padded_len` bytes, cut into
// `segment_bytes` segments (the last may be shorter); out[c * segs + s].
// `tables` (152 words, built by kvd/cuda_digest.py from the secret):
// [0, 128) stripe keys [stripe][lane], [128, 136) scramble keys,
// [136, 144) last-stripe keys, [144, 152) merge keys.

#define XXH_PRIME32_1 0x9E3779B1ull
#define XXH_PRIME64_1 0x9E3779B185EBCA87ull
#define XXH_MIX 0x165667919E3779F9ull
#define TABLE_WORDS 152
#define BLOCK_BYTES 1024
#define STRIPE_BYTES 64
#define STRIPES_PER_BLOCK 16

typedef unsigned long long u64;

__device__ __forceinline__ u64 accumulate(u64 acc, u64 data, u64 key, unsigned mask) {
    u64 keyed = data ^ key;
    acc += __shfl_xor_sync(mask, data, 1);
    return acc + (keyed & 0xFFFFFFFFull) * (keyed >> 32);
}

extern "C" __global__ void xxh3_segments(const u64* __restrict__ tables, u64 base, u64 stride,
                                         unsigned int padded_len, unsigned int segment_bytes,
                                         unsigned int segs_per_chunk, unsigned int total_segs,
                                         u64* __restrict__ out) {
    __shared__ u64 t[TABLE_WORDS];
    for (int i = threadIdx.x; i < TABLE_WORDS; i += blockDim.x) t[i] = tables[i];
    __syncthreads();
    const unsigned int g = (blockIdx.x * blockDim.x + threadIdx.x) >> 3;
    const int lane = threadIdx.x & 7;
    if (g >= total_segs) return;  // whole groups leave together: g is the same for all 8
    const unsigned mask = 0xFFu << (threadIdx.x & 24);
    const unsigned int chunk = g / segs_per_chunk, seg = g % segs_per_chunk;
    const unsigned int start = seg * segment_bytes;
    const unsigned int len = min(segment_bytes, padded_len - start);
    const u64* p = reinterpret_cast<const u64*>(base + chunk * stride + start) + lane;

    const u64 init[8] = {0xC2B2AE3Dull, XXH_PRIME64_1, 0xC2B2AE3D27D4EB4Full,
                         0x165667B19E3779F9ull, 0x85EBCA77C2B2AE63ull, 0x85EBCA77ull,
                         0x27D4EB2F165667C5ull, XXH_PRIME32_1};
    u64 acc = init[lane];
    const unsigned int blocks = (len - 1) / BLOCK_BYTES;
    for (unsigned int b = 0; b < blocks; ++b) {
        const u64* q = p + b * (BLOCK_BYTES / 8);
#pragma unroll
        for (int s = 0; s < STRIPES_PER_BLOCK; ++s) acc = accumulate(acc, q[s * 8], t[s * 8 + lane], mask);
        acc ^= acc >> 47;
        acc ^= t[128 + lane];
        acc *= XXH_PRIME32_1;
    }
    const unsigned int stripes = ((len - 1) - blocks * BLOCK_BYTES) / STRIPE_BYTES;
    const u64* q = p + blocks * (BLOCK_BYTES / 8);
    for (unsigned int s = 0; s < stripes; ++s) acc = accumulate(acc, q[s * 8], t[s * 8 + lane], mask);
    acc = accumulate(acc, p[(len - STRIPE_BYTES) / 8], t[136 + lane], mask);

    // merge: sum over pairs (2j, 2j+1) of fold64((acc[2j] ^ m[2j]) * (acc[2j+1] ^ m[2j+1]))
    const u64 mine = acc ^ t[144 + lane];
    const u64 other = __shfl_xor_sync(mask, mine, 1);
    u64 folded = (lane & 1) ? 0ull : (mine * other) ^ __umul64hi(mine, other);
    folded += __shfl_xor_sync(mask, folded, 1);
    folded += __shfl_xor_sync(mask, folded, 2);
    folded += __shfl_xor_sync(mask, folded, 4);
    u64 h = (u64)len * XXH_PRIME64_1 + folded;
    h ^= h >> 37;
    h *= XXH_MIX;
    h ^= h >> 32;
    if (lane == 0) out[g] = h;
}
