// libFuzzer target for the safetensors reader (built by the debug preset with GDN_FUZZ=ON):
//   mkdir -p /tmp/corpus && build/debug/tests/fuzz_safetensors /tmp/corpus
//   tests/data/safetensors_bad -max_total_time=60   (new inputs go to the first directory; keep the
//   committed corpus last)
// Any input must either parse or throw gdn::Error; a crash, leak or sanitizer report is a bug.
#include <cstddef>
#include <cstdint>

#include "gdn/core/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    gdn::SafeTensorsFile f = gdn::SafeTensorsFile::from_bytes(data, size, "fuzz");
    for (const auto& t : f.tensors()) {
      if (t.known_dtype) (void)f.view(t.name).numel();
    }
  } catch (const gdn::Error&) {
  }
  return 0;
}
