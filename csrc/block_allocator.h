// KV block allocator: a free list plus a reference count per block.
//
// Mirrors nanolab/block_allocator.py (PyBlockAllocator) exactly: same ids handed out in the same
// order, same errors with the same messages. Every method validates its whole input before it
// changes anything, so a call that throws leaves the allocator as it was.
#pragma once

#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <vector>

namespace nanolab {

// Raised when a request asks for more blocks than are free (mapped to nanolab.OutOfBlocksError).
class OutOfBlocks : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t num_blocks);

  // Takes n blocks from the front of the free list; each gets ref count 1.
  std::vector<int64_t> allocate(int64_t n);
  // Drops one reference per listed id; a block whose count reaches zero goes to the back of the free list.
  void free(const std::vector<int64_t>& block_ids);
  // Adds one reference per listed id (the block is now shared by one more holder).
  void incref(const std::vector<int64_t>& block_ids);

  int64_t ref_count(int64_t block_id) const;
  int64_t num_free() const { return static_cast<int64_t>(free_list_.size()); }
  int64_t num_total() const { return static_cast<int64_t>(ref_counts_.size()); }
  std::vector<int64_t> free_list() const { return {free_list_.begin(), free_list_.end()}; }

 private:
  void check_id(int64_t block_id) const;

  std::vector<int64_t> ref_counts_;  // ref_counts_[id] == 0 <=> id is on the free list
  std::deque<int64_t> free_list_;
};

}  // namespace nanolab
