#include "paged_attention.h"

#include "parallel.h"
#include "vec8.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace nanolab {

namespace {

constexpr int64_t kRowsPerItem = 16;     // query rows of one sequence handled by one work item
// One unit of work: query rows [row_begin, row_end) of one sequence, for the query heads that read
// kv heads [head_begin, head_end). Rows are relative to the sequence's first query row.
struct Item {
  int64_t seq;
  int64_t head_begin;
  int64_t head_end;
  int64_t row_begin;
  int64_t row_end;
  int64_t cost;  // multiply-adds, to hand out the big items first
};

// Per-thread buffers, reused across items.
struct Scratch {
  std::vector<float> q;       // (n_queries, head_dim) scaled queries
  std::vector<float> scores;  // (n_queries, n_keys) scores, then probabilities (unnormalised)
  std::vector<float> acc;     // (n_queries, head_dim) weighted sums of V
  std::vector<float> inv_sum;
};

int64_t query_begin(const PagedAttentionArgs& a, int64_t s) {
  return a.query_start_loc ? a.query_start_loc[s] : s;
}

int64_t query_len(const PagedAttentionArgs& a, int64_t s) {
  return a.query_start_loc ? a.query_start_loc[s + 1] - a.query_start_loc[s] : 1;
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  Vec8 acc = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc += load8(a + i) * load8(b + i);
  float sum = reduce8(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Four dot products of one query with four keys, each summed exactly as dot() sums it. One dot is a
// chain of dependent multiply-adds, each waiting for the last; four independent chains keep the
// multiply-add units busy while each waits.
inline void dot4(const float* __restrict q, const float* __restrict k0, const float* __restrict k1,
                 const float* __restrict k2, const float* __restrict k3, int64_t n, float* out) {
  Vec8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const Vec8 x = load8(q + i);
    a0 += x * load8(k0 + i);
    a1 += x * load8(k1 + i);
    a2 += x * load8(k2 + i);
    a3 += x * load8(k3 + i);
  }
  float s0 = reduce8(a0), s1 = reduce8(a1), s2 = reduce8(a2), s3 = reduce8(a3);
  for (; i < n; ++i) {
    s0 += q[i] * k0[i];
    s1 += q[i] * k1[i];
    s2 += q[i] * k2[i];
    s3 += q[i] * k3[i];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

// exp(x) for eight x <= 0 (scores minus their max), with no branch and no library call: x = n ln2 + r
// with |r| <= ln2 / 2, exp(r) by its Taylor polynomial to r^7 (relative error below 2e-7, about a
// float's rounding), and 2^n built in the exponent bits. Below -87, where exp(x) < 2^-125 counts for
// nothing next to the max's exp(0) = 1, it returns exp(-87).
inline Vec8 exp_nonpositive(Vec8 x) {
  typedef int32_t Int8 __attribute__((vector_size(32)));
  const Vec8 kRound = Vec8{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  x = x < -87.0f ? Vec8{} - 87.0f : x;
  const Vec8 shifted = x * 1.44269504f + kRound;  // n + kRound, n = round(x / ln2)
  const Vec8 n = shifted - kRound;
  const Vec8 r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln2 in two parts, so n ln2 is exact
  Vec8 p = Vec8{} + 1.98412698e-4f;                             // 1/7!
  p = p * r + 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  Int8 bits;
  std::memcpy(&bits, &shifted, sizeof bits);  // the low bits of `shifted` hold n (two's complement)
  bits = (bits + 127) << 23;                    // 2^n as a float: n + 127 in the exponent field
  Vec8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// The softmax of one query's scores over keys 0 .. n - 1, in place, unnormalised; returns 1 / sum.
// The max and the sum use eight lanes each, added up as a fixed tree, so they vectorise and the
// result depends only on the row.
inline float softmax_row(float* __restrict row, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
  if (n >= 8) {
    Vec8 lanes = load8(row);
    for (t = 8; t + 8 <= n; t += 8) {
      const Vec8 x = load8(row + t);
      lanes = lanes > x ? lanes : x;
    }
    for (int j = 0; j < 8; ++j) m = std::max(m, lanes[j]);
  }
  for (; t < n; ++t) m = std::max(m, row[t]);
  for (t = 0; t + 8 <= n; t += 8) store8(row + t, exp_nonpositive(load8(row + t) - m));
  if (t < n) {  // the last few, through a padded vector
    float tail[8];
    std::fill(tail, tail + 8, m);  // padding that exponentiates to 1, harmlessly
    std::copy(row + t, row + n, tail);
    const Vec8 e = exp_nonpositive(load8(tail) - m);
    for (int64_t i = 0; t + i < n; ++i) row[t + i] = e[i];
  }
  Vec8 lanes = {};
  for (t = 0; t + 8 <= n; t += 8) lanes += load8(row + t);
  float sum = reduce8(lanes);
  for (; t < n; ++t) sum += row[t];
  return 1.0f / sum;
}

// out[d] += sum over keys t < n of p[t] * v[t * stride + d], for d < D, in key order for every d.
// The sums for 32 values of d at a time stay in four vector registers across the keys.
inline void add_weighted_rows(float* __restrict out, const float* __restrict p, const float* __restrict v,
                              int64_t stride, int64_t n, int64_t D) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    Vec8 a0 = load8(out + d), a1 = load8(out + d + 8), a2 = load8(out + d + 16), a3 = load8(out + d + 24);
    for (int64_t t = 0; t < n; ++t) {
      const float* row = v + t * stride + d;
      const Vec8 w = Vec8{} + p[t];
      a0 += w * load8(row);
      a1 += w * load8(row + 8);
      a2 += w * load8(row + 16);
      a3 += w * load8(row + 24);
    }
    store8(out + d, a0), store8(out + d + 8, a1), store8(out + d + 16, a2), store8(out + d + 24, a3);
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t x = d; x < D; ++x) out[x] += p[t] * v[t * stride + x];
  }
}

// The first row of logical block j of a sequence in `cache`.
inline const float* block_start(const PagedAttentionArgs& a, const float* cache, const int32_t* table, int64_t j) {
  return cache + static_cast<int64_t>(table[j]) * a.block_size * a.n_kv_heads * a.head_dim;
}

// Asks the memory system to bring `rows` rows of a block, `span` floats each from `first`, into the
// core's second-level cache: one prefetch per 64-byte line.
inline void prefetch_block(const float* first, int64_t rows, int64_t row_stride, int64_t span) {
#if defined(__GNUC__) || defined(__clang__)
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t x = 0; x < span; x += 16) __builtin_prefetch(first + i * row_stride + x, 0, 1);
  }
#else
  (void)first, (void)rows, (void)row_stride, (void)span;
#endif
}

// One work item. Each block of keys is worked on one kv head at a time: that head's rows of the block
// (block_size rows of head_dim floats) stay in the nearest cache while every query reading them (the
// G query heads that share the kv head, in every row of the item) is served. The helpers it calls are
// inline functions, compiled into each target clone of this function (a lambda would be compiled once,
// for the baseline target).
NANOLAB_CLONES
void run_item(const PagedAttentionArgs& a, const Item& it, Scratch& s) {
  const int64_t D = a.head_dim, BS = a.block_size;
  const int64_t G = a.n_heads / a.n_kv_heads;     // query heads per kv head
  const int64_t KH = it.head_end - it.head_begin;  // kv heads in this item
  const int64_t QH = KH * G;                       // query heads per row in this item
  const int64_t ctx = a.context_lens[it.seq];
  const int64_t q0 = query_begin(a, it.seq) + it.row_begin;             // the item's first query row
  const int64_t first_pos = ctx - query_len(a, it.seq) + it.row_begin;  // and its position
  const int64_t n_rows = it.row_end - it.row_begin;
  const int64_t n_queries = n_rows * QH;      // query j: row j / QH, head head_begin * G + j % QH
  const int64_t n_keys = first_pos + n_rows;  // keys the item's last row sees
  const int64_t row_stride = a.n_kv_heads * D;
  const int64_t offset = it.head_begin * D;  // the item's first float in a row of the cache
  const int32_t* table = a.block_tables + it.seq * a.max_blocks_per_seq;
  // Blocks sit at scattered places, so nothing can guess where a sequence continues: while the kernel
  // works on a block, it asks for the next one, a kv head at a time. The hardware prefetcher follows
  // accesses within a 4 KB page; when the item's part of a row fills a page, it follows each row on its
  // own, and asking as well only queues more requests (measured: slower by 10 to 25% at 4 KB rows and
  // more, faster by as much below).
  const bool prefetch = KH * D * static_cast<int64_t>(sizeof(float)) < 4096;

  s.q.resize(n_queries * D);
  s.scores.resize(n_queries * n_keys);
  s.acc.assign(n_queries * D, 0.0f);
  s.inv_sum.resize(n_queries);
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* __restrict src = a.q + ((q0 + r) * a.n_heads + it.head_begin * G) * D;
    float* __restrict dst = &s.q[r * QH * D];
    for (int64_t x = 0; x < QH * D; ++x) dst[x] = src[x] * a.scale;
  }

  // Pass 1: scores, four keys at a time. Causal: row r (at position first_pos + r) sees keys up to
  // its own position, so it sees `visible` keys of the block that starts at key t0.
  for (int64_t t0 = 0; t0 < n_keys; t0 += BS) {
    const int64_t n = std::min(BS, n_keys - t0);
    const float* next = t0 + BS < n_keys ? block_start(a, a.k_cache, table, t0 / BS + 1) + offset : nullptr;
    const float* block = block_start(a, a.k_cache, table, t0 / BS) + offset;
    for (int64_t h = 0; h < KH; ++h) {
      if (prefetch && next) prefetch_block(next + h * D, std::min(BS, n_keys - t0 - BS), row_stride, D);
      const float* k = block + h * D;
      for (int64_t r = 0; r < n_rows; ++r) {
        const int64_t visible = std::min(n, first_pos + r + 1 - t0);
        for (int64_t j = r * QH + h * G; j < r * QH + (h + 1) * G && visible > 0; ++j) {
          const float* q = &s.q[j * D];
          float* out = &s.scores[j * n_keys + t0];
          int64_t t = 0;
          for (; t + 4 <= visible; t += 4) {
            const float* kt = k + t * row_stride;
            dot4(q, kt, kt + row_stride, kt + 2 * row_stride, kt + 3 * row_stride, D, out + t);
          }
          for (; t < visible; ++t) out[t] = dot(q, k + t * row_stride, D);
        }
      }
    }
  }
  // Softmax of each query over the keys it sees: minus the max, so exp never overflows.
  for (int64_t j = 0; j < n_queries; ++j) s.inv_sum[j] = softmax_row(&s.scores[j * n_keys], first_pos + j / QH + 1);
  // Pass 2: the probability-weighted sum of the value rows, block by block in the same order.
  for (int64_t t0 = 0; t0 < n_keys; t0 += BS) {
    const int64_t n = std::min(BS, n_keys - t0);
    const float* next = t0 + BS < n_keys ? block_start(a, a.v_cache, table, t0 / BS + 1) + offset : nullptr;
    const float* block = block_start(a, a.v_cache, table, t0 / BS) + offset;
    for (int64_t h = 0; h < KH; ++h) {
      if (prefetch && next) prefetch_block(next + h * D, std::min(BS, n_keys - t0 - BS), row_stride, D);
      for (int64_t r = 0; r < n_rows; ++r) {
        const int64_t visible = std::min(n, first_pos + r + 1 - t0);
        for (int64_t j = r * QH + h * G; j < r * QH + (h + 1) * G && visible > 0; ++j) {
          add_weighted_rows(&s.acc[j * D], &s.scores[j * n_keys + t0], block + h * D, row_stride, visible, D);
        }
      }
    }
  }
  for (int64_t j = 0; j < n_queries; ++j) {
    float* __restrict dst = a.out + ((q0 + j / QH) * a.n_heads + it.head_begin * G + j % QH) * D;
    const float* __restrict acc = &s.acc[j * D];
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] * s.inv_sum[j];
  }
}

std::string at(const char* name, int64_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }

}  // namespace

void check_paged_attention_args(const PagedAttentionArgs& a) {
  if (a.n_heads <= 0 || a.n_kv_heads <= 0 || a.n_heads % a.n_kv_heads != 0) {
    throw std::invalid_argument("n_heads (" + std::to_string(a.n_heads) + ") must be a positive multiple of " +
                                "n_kv_heads (" + std::to_string(a.n_kv_heads) + ")");
  }
  if (a.query_start_loc) {
    if (a.query_start_loc[0] != 0 || a.query_start_loc[a.num_seqs] != a.num_q_tokens) {
      throw std::invalid_argument("query_start_loc must start at 0 and end at the number of query tokens (" +
                                  std::to_string(a.num_q_tokens) + ")");
    }
  } else if (a.num_q_tokens != a.num_seqs) {
    throw std::invalid_argument("decode takes one query token per sequence: q has " +
                                std::to_string(a.num_q_tokens) + " tokens for " + std::to_string(a.num_seqs) +
                                " sequences");
  }
  const int64_t capacity = a.max_blocks_per_seq * a.block_size;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t ctx = a.context_lens[s], q_len = query_len(a, s);
    if (q_len < 0) {
      throw std::invalid_argument("query_start_loc must not decrease (it does at sequence " + std::to_string(s) + ")");
    }
    if (ctx > capacity) {
      throw std::invalid_argument(at("context_lens", s) + " is " + std::to_string(ctx) + " but block_tables holds " +
                                  std::to_string(a.max_blocks_per_seq) + " blocks of " + std::to_string(a.block_size) +
                                  " = " + std::to_string(capacity) + " tokens per sequence; widen block_tables");
    }
    if (ctx < q_len || ctx < 1) {
      throw std::invalid_argument(at("context_lens", s) + " is " + std::to_string(ctx) + " but the sequence has " +
                                  std::to_string(q_len) +
                                  " query token(s), whose own keys must already be in the cache (write_kv first)");
    }
    const int32_t* table = a.block_tables + s * a.max_blocks_per_seq;
    for (int64_t j = 0; j * a.block_size < ctx; ++j) {
      if (table[j] < 0 || table[j] >= a.num_blocks) {
        throw std::invalid_argument("block_tables[" + std::to_string(s) + ", " + std::to_string(j) + "] is " +
                                    std::to_string(table[j]) + ", which is not a block of the cache (num_blocks = " +
                                    std::to_string(a.num_blocks) + ")");
      }
    }
  }
}

void paged_attention(const PagedAttentionArgs& a, int num_threads) {
  const int64_t G = a.n_heads / a.n_kv_heads;
  int64_t tiles = 0;  // (sequence, row tile) pairs; with few of them, split the kv heads too
  for (int64_t s = 0; s < a.num_seqs; ++s) tiles += (query_len(a, s) + kRowsPerItem - 1) / kRowsPerItem;
  // Enough items for every thread to get about two; each item reads whole rows of its kv heads.
  const int64_t splits = std::clamp<int64_t>((2 * num_threads + tiles - 1) / std::max<int64_t>(tiles, 1), 1,
                                             a.n_kv_heads);
  const int64_t heads_per_item = (a.n_kv_heads + splits - 1) / splits;
  std::vector<Item> items;
  int64_t total = 0;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t q_len = query_len(a, s), first_pos = a.context_lens[s] - q_len;
    for (int64_t r = 0; r < q_len; r += kRowsPerItem) {
      const int64_t r_end = std::min(q_len, r + kRowsPerItem);
      for (int64_t h = 0; h < a.n_kv_heads; h += heads_per_item) {
        const int64_t h_end = std::min(a.n_kv_heads, h + heads_per_item);
        const int64_t cost = (r_end - r) * (h_end - h) * G * (first_pos + r_end) * a.head_dim * 2;
        items.push_back({s, h, h_end, r, r_end, cost});
        total += cost;
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });

  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto worker = [&]() {
    try {
      Scratch scratch;
      for (size_t i; (i = next.fetch_add(1)) < items.size();) run_item(a, items[i], scratch);
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
      next = items.size();  // the others stop early
    }
  };
  const int64_t n_threads =
      total < kSerialWork ? 1 : std::max<int64_t>(1, std::min<int64_t>(num_threads, items.size()));
  run_threads(n_threads, worker);
  if (error) std::rethrow_exception(error);
}

}  // namespace nanolab
