#pragma once

// Internal linkage on purpose: this header is compiled into several CPU
// translation units with different -m flags (AVX2, AVX-512), and a shared
// inline definition could let the linker keep an AVX-512 copy for the scalar
// path. `static` gives each unit its own copy.
#if defined(__CUDACC__)
#define EFFMEM_HD static __host__ __device__ __forceinline__
#else
#define EFFMEM_HD static inline
#endif
