// Python bindings for nanolab._C. The Python-facing API matches nanolab.block_allocator.PyBlockAllocator
// and the torch backend of nanolab.attention.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "block_allocator.h"
#include "linear_rows.h"
#include "paged_attention.h"

namespace py = pybind11;
using nanolab::BlockAllocator;

// Arrays come from torch CPU tensors via .numpy() (zero-copy). forcecast would silently copy a
// wrong-dtype or strided array, so nanolab.attention checks dtype and contiguity before calling.
using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;
using IntArray = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

namespace {

void expect(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

std::string shape_of(const py::array& x) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < x.ndim(); ++i) s += (i ? ", " : "") + std::to_string(x.shape(i));
  return s + (x.ndim() == 1 ? ",)" : ")");
}

py::array_t<float> paged_attention(const FloatArray& q, const FloatArray& k_cache, const FloatArray& v_cache,
                                   const IntArray& block_tables, const IntArray& context_lens,
                                   const std::optional<IntArray>& query_start_loc, float scale, int num_threads) {
  expect(q.ndim() == 3, "q must be (num_tokens, n_heads, head_dim), got shape " + shape_of(q));
  expect(k_cache.ndim() == 4, "k_cache must be (num_blocks, block_size, n_kv_heads, head_dim), got shape " +
                                  shape_of(k_cache));
  expect(shape_of(k_cache) == shape_of(v_cache),
         "k_cache " + shape_of(k_cache) + " and v_cache " + shape_of(v_cache) + " differ in shape");
  expect(k_cache.shape(3) == q.shape(2), "q has head_dim " + std::to_string(q.shape(2)) + " but the cache has " +
                                             std::to_string(k_cache.shape(3)));
  expect(block_tables.ndim() == 2, "block_tables must be (num_seqs, max_blocks_per_seq), got shape " +
                                       shape_of(block_tables));
  expect(context_lens.ndim() == 1 && context_lens.shape(0) == block_tables.shape(0),
         "context_lens " + shape_of(context_lens) + " needs one entry per row of block_tables " +
             shape_of(block_tables));
  if (query_start_loc) {
    expect(query_start_loc->ndim() == 1 && query_start_loc->shape(0) == block_tables.shape(0) + 1,
           "query_start_loc " + shape_of(*query_start_loc) + " needs num_seqs + 1 = " +
               std::to_string(block_tables.shape(0) + 1) + " entries");
  }
  py::array_t<float> out({q.shape(0), q.shape(1), q.shape(2)});
  nanolab::PagedAttentionArgs a{q.data(),
                                k_cache.data(),
                                v_cache.data(),
                                block_tables.data(),
                                context_lens.data(),
                                query_start_loc ? query_start_loc->data() : nullptr,
                                out.mutable_data(),
                                q.shape(0),
                                q.shape(1),
                                k_cache.shape(2),
                                q.shape(2),
                                k_cache.shape(0),
                                k_cache.shape(1),
                                block_tables.shape(0),
                                block_tables.shape(1),
                                scale};
  nanolab::check_paged_attention_args(a);
  py::gil_scoped_release release;  // the arrays stay alive: the caller's frame holds them
  nanolab::paged_attention(a, num_threads);
  return out;
}

py::array_t<float> linear_rows(const FloatArray& x, const FloatArray& weight, const std::optional<FloatArray>& bias,
                               int num_threads) {
  expect(x.ndim() == 2, "x must be (rows, in), got shape " + shape_of(x));
  expect(weight.ndim() == 2, "weight must be (out, in), got shape " + shape_of(weight));
  expect(weight.shape(1) == x.shape(1),
         "x " + shape_of(x) + " has " + std::to_string(x.shape(1)) + " columns but weight " + shape_of(weight) +
             " has " + std::to_string(weight.shape(1)));
  if (bias) {
    expect(bias->ndim() == 1 && bias->shape(0) == weight.shape(0),
           "bias " + shape_of(*bias) + " needs one entry per row of weight " + shape_of(weight));
  }
  py::array_t<float> y({x.shape(0), weight.shape(0)});
  const float* b = bias ? bias->data() : nullptr;
  float* out = y.mutable_data();
  py::gil_scoped_release release;  // the arrays stay alive: the caller's frame holds them
  nanolab::linear_rows(x.data(), x.shape(0), x.shape(1), weight.data(), weight.shape(0), b, out, num_threads);
  return y;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "nanolab's C++ kernels (private; use the re-exports in nanolab)";
#ifdef NANOLAB_OPENMP
  m.attr("threading") = "openmp";
#else
  m.attr("threading") = "std::thread";
#endif

  // Raise nanolab.errors.OutOfBlocksError, the same class the Python twin raises.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const nanolab::OutOfBlocks& e) {
      py::object cls = py::module_::import("nanolab.errors").attr("OutOfBlocksError");
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  py::class_<BlockAllocator>(m, "BlockAllocator")
      .def(py::init<int64_t>(), py::arg("num_blocks"))
      .def("allocate", &BlockAllocator::allocate, py::arg("n"))
      .def("free", &BlockAllocator::free, py::arg("block_ids"))
      .def("incref", &BlockAllocator::incref, py::arg("block_ids"))
      .def("ref_count", &BlockAllocator::ref_count, py::arg("block_id"))
      .def_property_readonly("num_free", &BlockAllocator::num_free)
      .def_property_readonly("num_total", &BlockAllocator::num_total)
      .def("free_list", &BlockAllocator::free_list)
      .def("__repr__", [](const BlockAllocator& a) {
        return "BlockAllocator(num_blocks=" + std::to_string(a.num_total()) +
               ", num_free=" + std::to_string(a.num_free()) + ")";
      });

  m.def("paged_attention", &paged_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("query_start_loc"), py::arg("scale"),
        py::arg("num_threads"),
        "Paged attention over nanolab's KV layout (see csrc/paged_attention.h); returns a new "
        "(num_tokens, n_heads, head_dim) float32 array. query_start_loc=None means decode.");

  m.def("linear_rows", &linear_rows, py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("num_threads"),
        "x @ weight.T + bias for a few rows of x (see csrc/linear_rows.h); returns a new (rows, out) float32 "
        "array. bias may be None.");
}
