#include "bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "offloadpp native core: direct-I/O engine, aligned buffers, fused CPU Adam";
  offloadpp::register_cpu(m);
  offloadpp::register_io(m);
  offloadpp::register_adam(m);
}
