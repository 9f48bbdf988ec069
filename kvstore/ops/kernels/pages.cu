// pages.cu -- pack/unpack whole pages between a node's page pool and a staging
// buffer (the bytes a transfer sends or receives).
//
// The pool is ONE contiguous uint8 array [num_slots, page_bytes]; staging is a
// contiguous uint8 array [n, page_bytes]. Both kernels are plain extern "C"
// __global__ functions so cupy.RawModule can get_function() them by name, and
// the file compiles standalone: `nvcc -arch=sm_90 -cubin pages.cu`.
//
// Work split: each page is cut into `parts` equal strided parts, one thread
// block per part. The host picks the grid size; the kernel derives `parts`
// from it (gridDim.x / n when the grid covers every page, else 1 with a
// grid-stride loop over pages), so any grid size is correct.
//
// Copy width: 16-byte (uint4) loads/stores when the page size and both base
// pointers are 16-byte aligned (always the case for CuPy allocations and
// page_bytes % 16 == 0); otherwise the widest of 8/4/2/1 bytes that divides
// both. The test is uniform across a page, so warps never diverge on it.

#include "copy.cuh"

// Gathers pages: out[i] = pool[slots[i]] for i in [0, n).
//   pool        device pointer to the page pool, uint8 [num_slots, page_bytes]
//   slots       device pointer to n int64 slot indices, each in [0, num_slots)
//               (validated on the host); duplicates are allowed
//   n           number of pages to copy
//   page_bytes  bytes per page (row length of pool and out)
//   out         device pointer to the staging buffer, uint8 [n, page_bytes];
//               must not overlap pool
extern "C" __global__ void pack_pages(const unsigned char* __restrict__ pool,
                                      const long long* __restrict__ slots,
                                      long long n, long long page_bytes,
                                      unsigned char* __restrict__ out)
{
    if (n <= 0 || page_bytes <= 0) return;
    const long long parts = parts_per_unit(n);
    const long long total = n * parts;
    for (long long w = blockIdx.x; w < total; w += gridDim.x) {
        const long long i = w / parts;
        const long long part = w - i * parts;
        copy_span(out + i * page_bytes, pool + slots[i] * page_bytes, page_bytes,
                  part * blockDim.x + threadIdx.x, parts * blockDim.x);
    }
}

// Scatters pages: pool[slots[i]] = staging[i] for i in [0, n).
//   staging     device pointer to the staging buffer, uint8 [n, page_bytes];
//               must not overlap pool
//   slots       device pointer to n int64 slot indices, each in [0, num_slots)
//               and pairwise distinct (validated on the host; duplicates
//               would race)
//   n           number of pages to copy
//   page_bytes  bytes per page (row length of staging and pool)
//   pool        device pointer to the page pool, uint8 [num_slots, page_bytes]
extern "C" __global__ void unpack_pages(const unsigned char* __restrict__ staging,
                                        const long long* __restrict__ slots,
                                        long long n, long long page_bytes,
                                        unsigned char* __restrict__ pool)
{
    if (n <= 0 || page_bytes <= 0) return;
    const long long parts = parts_per_unit(n);
    const long long total = n * parts;
    for (long long w = blockIdx.x; w < total; w += gridDim.x) {
        const long long i = w / parts;
        const long long part = w - i * parts;
        copy_span(pool + slots[i] * page_bytes, staging + i * page_bytes, page_bytes,
                  part * blockDim.x + threadIdx.x, parts * blockDim.x);
    }
}
