// The message of the gdn::Error a call throws, for tests that check what an error says. A call that
// throws nothing is a test failure (and gives "").
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "gdn/core/error.h"

namespace gdn::testing {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  ADD_FAILURE() << "no gdn::Error thrown";
  return "";
}

}  // namespace gdn::testing
