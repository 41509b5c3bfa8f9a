// CPU paged attention: query tokens attend to keys and values stored in fixed-size KV blocks.
//
// The layout is nanolab's paged KV layout (see nanolab/attention.py):
//   k_cache, v_cache  (num_blocks, block_size, n_kv_heads, head_dim) float32, C-contiguous
//   block_tables      (num_seqs, max_blocks_per_seq) int32: logical block j of sequence s is physical
//                     block block_tables[s][j]; entries past the context are never read
//   context_lens      (num_seqs,) int32: tokens in the cache for each sequence, new ones included
//   query_start_loc   (num_seqs + 1,) int32: sequence s owns query rows [qsl[s], qsl[s + 1]); these
//                     are its newest tokens, at positions [ctx - q_len, ctx), and row i sees keys
//                     0 ..= its own position (causal). Decode is q_len == 1 for every sequence.
//   q, out            (num_q_tokens, n_heads, head_dim) float32
// GQA: query head h reads kv head h / (n_heads / n_kv_heads).
//
// The softmax is computed in two passes per query (all scores and their max first, then exp, sum
// and the weighted sum of V), so it is stable for any score magnitude. Work is split into items of
// (sequence, up to 16 query rows, a range of kv heads) that threads take from a shared counter: OpenMP's
// team when built with OpenMP, which is torch's own once torch is imported (torch's pip wheels ship
// libgomp.so.1 and load it first, and a process loads one library per soname), else std::threads started
// for the call. An item works through a sequence's blocks one kv head at a time, so the rows of a block
// it has loaded serve every query that reads them (the GQA query heads sharing the kv head, and every
// query row of the item). Dot products, the softmax (with an exp of its own) and the weighted sums of V
// run on 8-float vectors (GCC and Clang vector extensions), every float sum in a fixed order. Every
// output row is computed by one item, so results do not depend on the batch or the number of threads.
#pragma once

#include <cstdint>

namespace nanolab {

struct PagedAttentionArgs {
  const float* q;
  const float* k_cache;
  const float* v_cache;
  const int32_t* block_tables;
  const int32_t* context_lens;
  const int32_t* query_start_loc;  // nullptr means decode: sequence s owns query row s
  float* out;
  int64_t num_q_tokens;
  int64_t n_heads;
  int64_t n_kv_heads;
  int64_t head_dim;
  int64_t num_blocks;
  int64_t block_size;
  int64_t num_seqs;
  int64_t max_blocks_per_seq;
  float scale;
};

// Checks every value the kernel would index with (context lengths against block-table capacity,
// query ranges, the physical block ids actually read) and throws std::invalid_argument or
// std::out_of_range naming the bad value. Cheap: O(num_seqs * blocks used).
void check_paged_attention_args(const PagedAttentionArgs& a);

// Runs the kernel with up to num_threads threads (1 runs on the calling thread). Call
// check_paged_attention_args first; this function trusts its input.
void paged_attention(const PagedAttentionArgs& a, int num_threads);

}  // namespace nanolab
