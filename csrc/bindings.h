// Each native component registers its Python bindings through one function, so
// components live in their own folders and module.cpp is the only shared file.
#pragma once
#include <pybind11/pybind11.h>

namespace offloadpp {
void register_io(pybind11::module_& m);    // csrc/io/
void register_adam(pybind11::module_& m);  // csrc/adam/
void register_cpu(pybind11::module_& m);   // csrc/cpu_features.cpp
}  // namespace offloadpp
