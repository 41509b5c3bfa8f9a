// A matrix product for one or two rows: y = x W^T + b, the layers' products of a decode step at batch 1
// or 2, where reading the weight from memory is all the time there is.
//
//   x       (rows, in) float32, C-contiguous
//   weight  (out, in) float32, C-contiguous: a torch.nn.Linear's weight as it is
//   bias    (out,) float32, or nullptr
//   y       (rows, out) float32
//
// Each thread streams a contiguous run of the weight's rows and serves every row of x from each weight
// row it loads: 8 weight rows at a time for one row of x, 6 for two, with every sum held in a register
// (more rows of x are served two at a time, each pair reading the whole weight again). Every output is one
// dot product summed in the fixed order of the kernels' 8-float vectors (vec8.h), the last `in mod 8`
// products through a zero-padded vector, so it does not depend on the number of rows or of threads.
#pragma once

#include <cstdint>

namespace nanolab {

void linear_rows(const float* x, int64_t rows, int64_t in, const float* weight, int64_t out, const float* bias,
                 float* y, int num_threads);

}  // namespace nanolab
