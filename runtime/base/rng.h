/* rng.h - counter-based random numbers: every value is a pure function of (seed, stream,
 * index), so any rank can draw exactly the elements of the full tensor it holds and every
 * parallel layout sees the same numbers. */
#ifndef AM_RNG_H
#define AM_RNG_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define AM_RNG_FN static inline __host__ __device__ /* the same numbers in the CUDA kernels */
#else
#define AM_RNG_FN static inline
#endif

AM_RNG_FN uint64_t am_splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* FNV-1a of a string: names a stream (a parameter's name). */
static inline uint64_t am_hash_str(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

/* Uniform in (0, 1]. */
AM_RNG_FN double am_rng_uniform(uint64_t seed, uint64_t stream, uint64_t index)
{
    uint64_t r = am_splitmix64(am_splitmix64(seed ^ stream) + index);
    return ((double)(r >> 11) + 1.0) * 0x1.0p-53;
}

/* Standard normal (Box-Muller on two uniforms of the same counter). */
static inline double am_rng_normal(uint64_t seed, uint64_t stream, uint64_t index)
{
    double u1 = am_rng_uniform(seed, stream, 2 * index), u2 = am_rng_uniform(seed, stream, 2 * index + 1);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* Dropout's mask: element `index` of stream `stream` is kept (and scaled by 1 / (1 - p))
 * when its uniform exceeds p, which it does with probability 1 - p. */
AM_RNG_FN int am_rng_keep(uint64_t seed, uint64_t stream, uint64_t index, float p)
{
    return am_rng_uniform(seed, stream, index) > (double)p;
}

#endif
