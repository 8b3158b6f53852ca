# Checks that a checkpointing example restarts correctly after a crash:
#   1. run it uninterrupted to STEPS steps in a fresh store: checksum A;
#   2. run it in another fresh store with --crash-at CRASH_AT: it must die with
#      exit status 3 and print no checksum;
#   3. run it again on that store to STEPS steps: it must say it restarted from a
#      snapshot (not from step 0) and print checksum A.
# Used by the C and the Fortran example (examples/*/CMakeLists.txt):
#   cmake -DEXE=... -DWORK=DIR -DSTEPS=N -DCRASH_AT=M [-DEVERY=K] -P restart_check.cmake
foreach(var EXE WORK STEPS CRASH_AT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "restart_check.cmake: -D${var}=... is missing")
  endif()
endforeach()
if(NOT DEFINED EVERY)
  set(EVERY 100)
endif()

file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")

function(run_example store expect_rc out_var)
  execute_process(COMMAND "${EXE}" "${WORK}/${store}" ${STEPS} --every ${EVERY} ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REPLACE ";" " " args "${ARGN}")
  message(STATUS "${store} ${args}: exit ${rc}\n${out}${err}")
  if(NOT rc STREQUAL "${expect_rc}")
    message(FATAL_ERROR "${EXE} ${WORK}/${store} ${STEPS} ${args}: exit status ${rc}, expected ${expect_rc}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

function(checksum_of out var)
  string(REGEX MATCH "checksum: *([^\n]+)" line "${out}")
  if(NOT line)
    message(FATAL_ERROR "no 'checksum:' line in the output:\n${out}")
  endif()
  string(STRIP "${CMAKE_MATCH_1}" value)
  set(${var} "${value}" PARENT_SCOPE)
endfunction()

run_example(straight 0 out)
checksum_of("${out}" straight_sum)
if(NOT out MATCHES "starting fresh")
  message(FATAL_ERROR "the uninterrupted run in a fresh store did not start fresh:\n${out}")
endif()

run_example(crashed 3 out --crash-at ${CRASH_AT})
if(out MATCHES "checksum:")
  message(FATAL_ERROR "the run told to crash at step ${CRASH_AT} printed a checksum:\n${out}")
endif()

run_example(crashed 0 out)
if(NOT out MATCHES "restarted from step-0*([1-9][0-9]*)")
  message(FATAL_ERROR "the run after the crash did not restart from a snapshot:\n${out}")
endif()
set(restart_step ${CMAKE_MATCH_1})
if(restart_step GREATER ${CRASH_AT})
  message(FATAL_ERROR "restarted from step ${restart_step}, after the crash at step ${CRASH_AT}")
endif()
checksum_of("${out}" restarted_sum)

if(NOT restarted_sum STREQUAL straight_sum)
  message(FATAL_ERROR "checksum after crash and restart (${restarted_sum}) differs from the uninterrupted run's (${straight_sum})")
endif()
message(STATUS "restart from step ${restart_step} after a crash at step ${CRASH_AT}: same checksum ${straight_sum}")
file(REMOVE_RECURSE "${WORK}")
