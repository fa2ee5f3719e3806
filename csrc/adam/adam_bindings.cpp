#include "bindings.h"

namespace offloadpp {
void register_adam(pybind11::module_& m) {}
}  // namespace offloadpp
