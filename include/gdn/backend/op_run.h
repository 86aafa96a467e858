// `gdntrain ops run`: runs one op on named tensors from a safetensors file and writes the results
// (outputs, and gradients with --backward) to another. Scalar attributes come from the input
// file's __metadata__ and from `attrs` (which win).
#pragma once

#include <map>
#include <string>

#include "gdn/backend/registry.h"

namespace gdn {

struct OpRunResult {
  std::string impl;                  // the implementation that ran
  std::vector<std::string> written;  // tensor names written
};

OpRunResult run_op_file(const std::string& op, Backend backend, const std::string& in_path,
                        const std::string& out_path, bool backward,
                        const std::map<std::string, double>& attrs);

}  // namespace gdn
