# cmake -P script for the failure tests: runs CMD (a ;-list), expects a non-zero exit status
# within MAX_S seconds and output matching EXPECT (a regex). Prints the output either way.
#   cmake -DCMD="mpirun;-np;2;prog;hang;2" -DMAX_S=30 -DEXPECT="rank 1" -P expect_failure.cmake
string(TIMESTAMP t0 "%s" UTC)
execute_process(COMMAND ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out
                TIMEOUT ${MAX_S})
string(TIMESTAMP t1 "%s" UTC)
math(EXPR elapsed "${t1} - ${t0}")
message("exit status: ${rc}; ${elapsed} s\n---- output ----\n${out}\n----------------")
if(rc STREQUAL "0")
  message(FATAL_ERROR "FAIL: the job exited 0 although a rank failed")
endif()
if(rc MATCHES "timeout|Process terminated")
  message(FATAL_ERROR "FAIL: the job did not end within ${MAX_S} s (${rc})")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "FAIL: the output does not match: ${EXPECT}")
endif()
message("PASS: exit status ${rc} after ${elapsed} s, output names the rank")
