#include "linear_rows.h"

#include <algorithm>
#include <atomic>

#include "parallel.h"
#include "vec8.h"

namespace nanolab {

namespace {

// The helpers are always inlined into run_range (NANOLAB_INLINE, vec8.h).
// Eight floats from p, of which the first `count` (< 8) are read and the rest are zero.
NANOLAB_INLINE Vec8 load_part(const float* p, int64_t count) {
  float part[8] = {};
  std::copy(p, p + count, part);
  return load8(part);
}

// Outputs [n, n + R) of x's rows [0, M): the R weight rows' vectors are loaded once for every row of x.
// The last in % 8 products go through zero-padded vectors, so that every product is added the same way
// (a scalar tail could be fused into a multiply-add in one place and not in another); each output is then
// reduce8 of its lanes, plus the bias.
template <int M, int R>
NANOLAB_INLINE void weight_rows(const float* __restrict x, int64_t in, const float* __restrict w, int64_t n,
                                const float* bias, float* __restrict y, int64_t out) {
  Vec8 acc[M][R] = {};
  const float* w0 = w + n * in;
  int64_t k = 0;
  for (; k + 8 <= in; k += 8) {
    Vec8 wv[R];
    for (int j = 0; j < R; ++j) wv[j] = load8(w0 + j * in + k);
    for (int m = 0; m < M; ++m) {
      const Vec8 xv = load8(x + m * in + k);
      for (int j = 0; j < R; ++j) acc[m][j] += xv * wv[j];
    }
  }
  if (k < in) {
    Vec8 wv[R];
    for (int j = 0; j < R; ++j) wv[j] = load_part(w0 + j * in + k, in - k);
    for (int m = 0; m < M; ++m) {
      const Vec8 xv = load_part(x + m * in + k, in - k);
      for (int j = 0; j < R; ++j) acc[m][j] += xv * wv[j];
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < R; ++j) {
      const float sum = reduce8(acc[m][j]);
      y[m * out + n + j] = bias ? sum + bias[n + j] : sum;
    }
  }
}

// Outputs [n_begin, n_end) of M rows of x, R weight rows at a time, the last few one at a time.
template <int M, int R>
NANOLAB_INLINE void output_range(const float* x, int64_t in, const float* w, int64_t n_begin, int64_t n_end,
                         const float* bias, float* y, int64_t out) {
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) weight_rows<M, R>(x, in, w, n, bias, y, out);
  for (; n < n_end; ++n) weight_rows<M, 1>(x, in, w, n, bias, y, out);
}

// Outputs [n_begin, n_end) of every row of x: two rows at a time, then the last one.
NANOLAB_CLONES
void run_range(const float* x, int64_t rows, int64_t in, const float* w, int64_t n_begin, int64_t n_end,
               const float* bias, float* y, int64_t out) {
  int64_t m = 0;
  for (; m + 2 <= rows; m += 2) output_range<2, 6>(x + m * in, in, w, n_begin, n_end, bias, y + m * out, out);
  if (m < rows) output_range<1, 8>(x + m * in, in, w, n_begin, n_end, bias, y + m * out, out);
}

}  // namespace

void linear_rows(const float* x, int64_t rows, int64_t in, const float* weight, int64_t out, const float* bias,
                 float* y, int num_threads) {
  if (rows <= 0 || out <= 0) return;
  // A few runs of the weight's rows per thread, taken from a shared counter, so a thread that lost its
  // core for a while leaves its later runs to the others. Each run is at least 64 rows (a whole number
  // of 8s), so that it streams.
  const int64_t work = rows * out * in;
  const int64_t n_threads = work < kSerialWork ? 1 : std::max<int64_t>(1, num_threads);
  const int64_t run = std::max<int64_t>(64, (out / (4 * n_threads) + 7) / 8 * 8);
  const int64_t n_runs = (out + run - 1) / run;
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    for (int64_t i; (i = next.fetch_add(1)) < n_runs;) {
      run_range(x, rows, in, weight, i * run, std::min(out, (i + 1) * run), bias, y, out);
    }
  };
  run_threads(std::min(n_threads, n_runs), worker);
}

}  // namespace nanolab
