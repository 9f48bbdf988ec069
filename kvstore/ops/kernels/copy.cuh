// copy.cuh -- device helpers shared by pages.cu and engine.cu: a strided
// span copy at the widest aligned width, and the split of a grid into
// thread blocks per unit of work. Header only; each .cu still compiles on its
// own with `nvcc -arch=sm_90 -cubin FILE.cu` (the include resolves next to
// the file; CuPy passes the kernel folder with -I).
#pragma once

typedef unsigned long long kv_u64;

// Copies elements first, first+stride, ... of a span of `bytes` bytes, using
// elements of type T (bytes is a multiple of sizeof(T)).
template <typename T>
__device__ __forceinline__ void copy_as(unsigned char* __restrict__ dst,
                                        const unsigned char* __restrict__ src,
                                        long long bytes, long long first,
                                        long long stride)
{
    T* d = reinterpret_cast<T*>(dst);
    const T* s = reinterpret_cast<const T*>(src);
    const long long count = bytes / (long long)sizeof(T);
    for (long long j = first; j < count; j += stride) {
        d[j] = s[j];
    }
}

// Copies a span with the widest element width that divides the span length
// and both pointers. `first`/`stride` index elements of that width.
__device__ __forceinline__ void copy_span(unsigned char* __restrict__ dst,
                                          const unsigned char* __restrict__ src,
                                          long long bytes, long long first,
                                          long long stride)
{
    const kv_u64 mix = (kv_u64)dst | (kv_u64)src | (kv_u64)bytes;
    if ((mix & 15ull) == 0) {
        copy_as<uint4>(dst, src, bytes, first, stride);
    } else if ((mix & 7ull) == 0) {
        copy_as<uint2>(dst, src, bytes, first, stride);
    } else if ((mix & 3ull) == 0) {
        copy_as<unsigned int>(dst, src, bytes, first, stride);
    } else if ((mix & 1ull) == 0) {
        copy_as<unsigned short>(dst, src, bytes, first, stride);
    } else {
        copy_as<unsigned char>(dst, src, bytes, first, stride);
    }
}

// Thread blocks that share one unit of work: gridDim.x / units when the grid
// covers every unit, else 1 (the blocks then grid-stride over the units).
__device__ __forceinline__ long long parts_per_unit(long long units)
{
    const long long grid = (long long)gridDim.x;
    return grid >= units ? grid / units : 1;
}
