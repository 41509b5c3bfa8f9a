#include "block_allocator.h"

#include <unordered_map>

namespace nanolab {

BlockAllocator::BlockAllocator(int64_t num_blocks) {
  if (num_blocks <= 0) {
    throw std::invalid_argument("num_blocks must be positive, got " + std::to_string(num_blocks));
  }
  ref_counts_.assign(static_cast<size_t>(num_blocks), 0);
  for (int64_t i = 0; i < num_blocks; ++i) free_list_.push_back(i);
}

void BlockAllocator::check_id(int64_t block_id) const {
  if (block_id < 0 || block_id >= num_total()) {
    throw std::invalid_argument("block id " + std::to_string(block_id) + " is out of range [0, " +
                                std::to_string(num_total()) + ")");
  }
}

int64_t BlockAllocator::ref_count(int64_t block_id) const {
  check_id(block_id);
  return ref_counts_[block_id];
}

std::vector<int64_t> BlockAllocator::allocate(int64_t n) {
  if (n < 0) {
    throw std::invalid_argument("cannot allocate a negative number of blocks (" + std::to_string(n) + ")");
  }
  if (n > num_free()) {
    throw OutOfBlocks("cannot allocate " + std::to_string(n) + " blocks: only " + std::to_string(num_free()) +
                      " of " + std::to_string(num_total()) +
                      " are free; free some blocks first or create the allocator with more blocks");
  }
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    int64_t id = free_list_.front();
    free_list_.pop_front();
    ref_counts_[id] = 1;
    out.push_back(id);
  }
  return out;
}

void BlockAllocator::free(const std::vector<int64_t>& block_ids) {
  // Validate everything first: an id listed k times needs at least k references.
  std::unordered_map<int64_t, int64_t> drops;
  for (int64_t id : block_ids) {
    check_id(id);
    int64_t k = ++drops[id];
    if (k > ref_counts_[id]) {
      throw std::invalid_argument("double free of block " + std::to_string(id) +
                                  ": it is already free; free each block once per holder");
    }
  }
  for (int64_t id : block_ids) {
    if (--ref_counts_[id] == 0) free_list_.push_back(id);
  }
}

void BlockAllocator::incref(const std::vector<int64_t>& block_ids) {
  for (int64_t id : block_ids) {
    check_id(id);
    if (ref_counts_[id] == 0) {
      throw std::invalid_argument("cannot incref block " + std::to_string(id) +
                                  ": it is free; only allocated blocks can be shared");
    }
  }
  for (int64_t id : block_ids) ++ref_counts_[id];
}

}  // namespace nanolab
