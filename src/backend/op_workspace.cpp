#include "gdn/backend/op_workspace.h"

#include "gdn/core/error.h"

namespace gdn {

void check_op_workspace(const char* op, size_t want, size_t bound) {
  GDN_CHECK_HINT(want <= bound,
                 "the op's declared <op>_workspace_bytes() must bound every request its kernels "
                 "make; fix the declaration (or the planner's shapes), not the bound region",
                 "op workspace: {} requested {} bytes but the bound (planned) region holds only {} "
                 "bytes",
                 op != nullptr ? op : "(unnamed op)", want, bound);
}

}  // namespace gdn
