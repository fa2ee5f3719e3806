#pragma once

#include <string>

#include "io/io_common.h"

namespace offloadpp {
namespace io {

struct ProbeResult {
  std::string name;
  bool compiled = false;
  bool works = false;
  int err = 0;  // errno of the failure, 0 if none
  std::string detail;
};

// Never throws for I/O failures: they are the answer (works=false, err, detail).
ProbeResult probe_backend(BackendKind kind, const std::string& directory, bool direct);

}  // namespace io
}  // namespace offloadpp
