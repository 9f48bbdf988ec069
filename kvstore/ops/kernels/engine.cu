// engine.cu -- gather/scatter between an inference engine's paged KV cache
// and a node's page pool.
//
// Engine layout: per layer l a K and a V tensor, each C-contiguous
// [num_blocks, block_tokens, kv_heads, head_dim] of any dtype (raw bytes
// here), so block b of a tensor is the byte span [b * block_bytes,
// (b + 1) * block_bytes).
// Page layout: pool is uint8 [num_slots, page_bytes], and one page is
// [num_layers][2 (K=0, V=1)][block_bytes], so page_bytes ==
// num_layers * 2 * block_bytes (validated on the host).
//
// The host also passes other engine layouts as segments (kvstore/ops/base.py):
// a [2, num_blocks, ...] layer as its two halves, and a fused "blocks" layer
// as one segment, with num_layers = segments / 2. Only the pointer table and
// block_bytes change; the kernels copy 2 * num_layers equal segments per page.
//
// One unit of work is one (page i, segment r) pair, r = 2 * l + t, and it
// copies block_bytes bytes. Units of the same page are adjacent, so
// neighbouring thread blocks write neighbouring pool bytes. Each unit is cut
// into `parts` strided parts, one thread block per part; the kernel derives
// `parts` from the grid size (see parts_per_unit), so any grid is correct.
//
// Copy width: 16-byte (uint4) when block_bytes and both span pointers are
// 16-byte aligned (checked per unit, so a misaligned layer tensor only slows
// itself down), else the widest of 8/4/2/1 that fits. The check is uniform
// across a thread block, so warps never diverge on it.
//
// Standalone: `nvcc -arch=sm_90 -cubin engine.cu`; cupy.RawModule can
// get_function("gather_blocks") / ("scatter_blocks").

#include "copy.cuh"

// Engine -> pages: for each i in [0, n), layer l, kv t:
//   pool[slots[i]][l][t][:] = bytes of kv_caches[l][t][block_ids[i]].
//   layer_ptrs   device array of 2 * num_layers device pointers (as uint64):
//                K0, V0, K1, V1, ...; each the base of a C-contiguous
//                [num_blocks, ...] engine tensor
//   block_ids    device pointer to n int64 engine block ids, each in
//                [0, num_blocks); duplicates are allowed (read side)
//   slots        device pointer to n int64 target slots, each in
//                [0, num_slots) and pairwise distinct (validated on the host)
//   n            number of pages to fill
//   num_layers   number of layers (K/V tensor pairs)
//   block_bytes  bytes of one engine block of one tensor
//   pool         device pointer to the page pool, uint8 [num_slots, page_bytes]
//   page_bytes   bytes per page == num_layers * 2 * block_bytes
extern "C" __global__ void gather_blocks(const kv_u64* __restrict__ layer_ptrs,
                                         const long long* __restrict__ block_ids,
                                         const long long* __restrict__ slots,
                                         long long n, long long num_layers,
                                         long long block_bytes,
                                         unsigned char* __restrict__ pool,
                                         long long page_bytes)
{
    if (n <= 0 || num_layers <= 0 || block_bytes <= 0) return;
    const long long segments = 2 * num_layers;
    const long long units = n * segments;
    const long long parts = parts_per_unit(units);
    const long long total = units * parts;
    for (long long w = blockIdx.x; w < total; w += gridDim.x) {
        const long long unit = w / parts;
        const long long part = w - unit * parts;
        const long long i = unit / segments;
        const long long r = unit - i * segments;
        const unsigned char* src =
            reinterpret_cast<const unsigned char*>(layer_ptrs[r]) + block_ids[i] * block_bytes;
        unsigned char* dst = pool + slots[i] * page_bytes + r * block_bytes;
        copy_span(dst, src, block_bytes, part * blockDim.x + threadIdx.x,
                  parts * blockDim.x);
    }
}

// Pages -> engine: for each i in [0, n), layer l, kv t:
//   bytes of kv_caches[l][t][block_ids[i]] = pool[slots[i]][l][t][:].
//   layer_ptrs   device array of 2 * num_layers device pointers (as uint64):
//                K0, V0, K1, V1, ...; pairwise distinct tensors
//   block_ids    device pointer to n int64 target block ids, each in
//                [0, num_blocks) and pairwise distinct (validated on the host)
//   slots        device pointer to n int64 source slots, each in
//                [0, num_slots); duplicates are allowed (read side)
//   n            number of pages to copy out
//   num_layers   number of layers (K/V tensor pairs)
//   block_bytes  bytes of one engine block of one tensor
//   pool         device pointer to the page pool, uint8 [num_slots, page_bytes]
//   page_bytes   bytes per page == num_layers * 2 * block_bytes
extern "C" __global__ void scatter_blocks(const kv_u64* __restrict__ layer_ptrs,
                                          const long long* __restrict__ block_ids,
                                          const long long* __restrict__ slots,
                                          long long n, long long num_layers,
                                          long long block_bytes,
                                          const unsigned char* __restrict__ pool,
                                          long long page_bytes)
{
    if (n <= 0 || num_layers <= 0 || block_bytes <= 0) return;
    const long long segments = 2 * num_layers;
    const long long units = n * segments;
    const long long parts = parts_per_unit(units);
    const long long total = units * parts;
    for (long long w = blockIdx.x; w < total; w += gridDim.x) {
        const long long unit = w / parts;
        const long long part = w - unit * parts;
        const long long i = unit / segments;
        const long long r = unit - i * segments;
        unsigned char* dst =
            reinterpret_cast<unsigned char*>(layer_ptrs[r]) + block_ids[i] * block_bytes;
        const unsigned char* src = pool + slots[i] * page_bytes + r * block_bytes;
        copy_span(dst, src, block_bytes, part * blockDim.x + threadIdx.x,
                  parts * blockDim.x);
    }
}
