#include "paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

// On x86-64 with GCC or Clang, the hot function is compiled twice (AVX2+FMA and baseline) and the
// loader picks the one the CPU supports, so a portable build still gets wide vectors.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define NANOLAB_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define NANOLAB_CLONES
#endif

namespace nanolab {

namespace {

constexpr int64_t kRowsPerItem = 16;     // query rows of one sequence handled by one work item
constexpr int64_t kSerialWork = 1500000;  // below this many multiply-adds, starting threads costs more than it saves

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

inline float reduce8(const float* acc) {
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// A dot product written so the compiler can vectorise it without reordering any one float sum:
// eight accumulators (one vector register), added up as a fixed tree at the end.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float sum = reduce8(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Calls fn(t, row) for the keys t = 0 .. n_keys - 1 in order; row points at key t's first kv head
// of interest in `cache`. Walks the sequence's block table one block at a time, and while it works
// on a block it asks the memory system for the next one: blocks sit at scattered places, so the
// hardware prefetcher cannot guess where the sequence continues.
template <class Fn>
inline void for_each_key(const PagedAttentionArgs& a, const float* cache, const int32_t* table, int64_t n_keys,
                         int64_t head_begin, int64_t n_floats, Fn&& fn) {
  const int64_t B = a.block_size, row_stride = a.n_kv_heads * a.head_dim;
  auto block_start = [&](int64_t j) {
    return cache + static_cast<int64_t>(table[j]) * B * row_stride + head_begin * a.head_dim;
  };
  for (int64_t t0 = 0; t0 < n_keys; t0 += B) {
    const float* block = block_start(t0 / B);
    const float* next = t0 + B < n_keys ? block_start(t0 / B + 1) : nullptr;
    const int64_t n = std::min(B, n_keys - t0);
    for (int64_t i = 0; i < n; ++i) {
#if defined(__GNUC__) || defined(__clang__)
      if (next) {  // one prefetch per 64-byte cache line of the same row in the next block
        for (int64_t x = 0; x < n_floats; x += 16) __builtin_prefetch(next + i * row_stride + x);
      }
#endif
      fn(t0 + i, block + i * row_stride);
    }
  }
}

NANOLAB_CLONES
void run_item(const PagedAttentionArgs& a, const Item& it, Scratch& s) {
  const int64_t D = a.head_dim;
  const int64_t G = a.n_heads / a.n_kv_heads;            // query heads per kv head
  const int64_t QH = (it.head_end - it.head_begin) * G;  // query heads per row in this item
  const int64_t ctx = a.context_lens[it.seq];
  const int64_t q0 = query_begin(a, it.seq) + it.row_begin;             // the item's first query row
  const int64_t first_pos = ctx - query_len(a, it.seq) + it.row_begin;  // and its position
  const int64_t n_rows = it.row_end - it.row_begin;
  const int64_t n_queries = n_rows * QH;      // query j: row j / QH, head head_begin * G + j % QH
  const int64_t n_keys = first_pos + n_rows;  // keys the item's last row sees
  const int32_t* table = a.block_tables + it.seq * a.max_blocks_per_seq;

  s.q.resize(n_queries * D);
  s.scores.resize(n_queries * n_keys);
  s.acc.assign(n_queries * D, 0.0f);
  s.inv_sum.resize(n_queries);
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* __restrict src = a.q + ((q0 + r) * a.n_heads + it.head_begin * G) * D;
    float* __restrict dst = &s.q[r * QH * D];
    for (int64_t x = 0; x < QH * D; ++x) dst[x] = src[x] * a.scale;
  }
  // Causal: key t is seen by the rows at positions >= t, i.e. by queries j >= first_query(t).
  auto first_query = [&](int64_t t) { return std::max<int64_t>(0, t - first_pos) * QH; };

  // Pass 1: scores.
  for_each_key(a, a.k_cache, table, n_keys, it.head_begin, QH / G * D, [&](int64_t t, const float* krow) {
    for (int64_t j = first_query(t); j < n_queries; ++j) {
      s.scores[j * n_keys + t] = dot(&s.q[j * D], krow + (j % QH) / G * D, D);
    }
  });
  // Softmax of each query over the keys it sees: subtract the max, so exp never overflows.
  for (int64_t j = 0; j < n_queries; ++j) {
    float* row = &s.scores[j * n_keys];
    const int64_t seen = first_pos + j / QH + 1;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < seen; ++t) m = std::max(m, row[t]);
    float sum = 0.0f;
    for (int64_t t = 0; t < seen; ++t) {
      row[t] = std::exp(row[t] - m);
      sum += row[t];
    }
    s.inv_sum[j] = 1.0f / sum;
  }
  // Pass 2: probability-weighted sum of the value rows.
  for_each_key(a, a.v_cache, table, n_keys, it.head_begin, QH / G * D, [&](int64_t t, const float* vrow) {
    for (int64_t j = first_query(t); j < n_queries; ++j) {
      const float p = s.scores[j * n_keys + t];
      const float* __restrict v = vrow + (j % QH) / G * D;
      float* __restrict acc = &s.acc[j * D];
      for (int64_t d = 0; d < D; ++d) acc[d] += p * v[d];
    }
  });
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
#ifdef NANOLAB_OPENMP
  // Built with OpenMP: the work runs on OpenMP's thread team. Imported after torch's CPU build, this is
  // torch's own team (the process has one libgomp.so.1 and torch's was loaded first), whose threads are
  // started already and often still spin-waiting after the last matmul. Threads of our own would share the
  // cores with those spinning threads; these are the same threads.
  if (n_threads > 1) {
#pragma omp parallel num_threads(static_cast<int>(n_threads))
    worker();
  } else {
    worker();
  }
#else
  std::vector<std::thread> threads;
  for (int64_t i = 1; i < n_threads; ++i) {
    try {
      threads.emplace_back(worker);
    } catch (const std::system_error&) {
      break;  // the system refused another thread: the ones running share the work
    }
  }
  worker();  // the calling thread works too
  for (auto& t : threads) t.join();
#endif
  if (error) std::rethrow_exception(error);
}

}  // namespace nanolab
