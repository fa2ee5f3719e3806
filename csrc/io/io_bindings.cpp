#include "bindings.h"

namespace offloadpp {
void register_io(pybind11::module_& m) {}
}  // namespace offloadpp
