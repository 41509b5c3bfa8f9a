// Eight-float vectors for the kernels' inner loops, and the build's two targets.
#pragma once

#include <cstring>

// On x86-64 with GCC or Clang, a function marked NANOLAB_CLONES is compiled twice (AVX2+FMA and baseline)
// and the loader picks the one the CPU supports, so a portable build still gets wide vectors. The helpers
// below are inline, so each clone gets its own copy of them.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define NANOLAB_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define NANOLAB_CLONES
#endif

// A helper of a cloned function that must be compiled into each clone: one left out of line is compiled
// once, for the baseline target (no FMA), and rounds differently from the clone that calls it.
#if defined(__GNUC__) || defined(__clang__)
#define NANOLAB_INLINE inline __attribute__((always_inline))
#else
#define NANOLAB_INLINE inline
#endif

namespace nanolab {

// Eight floats that the compiler keeps in one vector register (GCC and Clang vector extensions): an
// AVX register in the x86-64-v3 clone, two SSE registers in the baseline one. Lane i of a sum adds up
// elements i, i + 8, i + 16, ... in order; every sum in the kernels is this, then a fixed tree over the
// lanes, so a result depends only on its inputs, never on the batch or the threads.
typedef float Vec8 __attribute__((vector_size(32)));

NANOLAB_INLINE Vec8 load8(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}

NANOLAB_INLINE void store8(float* p, Vec8 v) { std::memcpy(p, &v, sizeof v); }

NANOLAB_INLINE float reduce8(Vec8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

}  // namespace nanolab
