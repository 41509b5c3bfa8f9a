// Python bindings for nanolab._C. The Python-facing API matches nanolab.block_allocator.PyBlockAllocator.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "block_allocator.h"

namespace py = pybind11;
using nanolab::BlockAllocator;

PYBIND11_MODULE(_C, m) {
  m.doc() = "nanolab's C++ kernels (private; use the re-exports in nanolab)";

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
}
