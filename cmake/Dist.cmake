# src/dist (docs/DISTRIBUTED.md). MPI is optional: CMake's FindMPI looks for it (Debian:
# libopenmpi-dev, which scripts/setup.sh installs); without it the MPI communicator is absent and
# asking for it is an error saying so. NCCL is found with the CUDA toolkit (CMakeLists.txt).
option(GDN_MPI "Build the MPI communicator (multi-rank runs on the cpu backend) when MPI is found" ON)
set(GDN_HAVE_MPI OFF)
if(GDN_MPI)
  find_package(MPI COMPONENTS C)
  if(MPI_C_FOUND)
    set(GDN_HAVE_MPI ON)
    # Only src/dist/comm_mpi.cpp sees MPI: its headers and GDN_WITH_MPI are set on that one file
    # (every other file keeps its compile line, and ccache its hits), and FindMPI's compile
    # options (-pthread) never reach nvcc. The library is linked wherever libgdn is.
    get_target_property(GDN_MPI_INCLUDES MPI::MPI_C INTERFACE_INCLUDE_DIRECTORIES)
    set_source_files_properties(${PROJECT_SOURCE_DIR}/src/dist/comm_mpi.cpp
                                PROPERTIES COMPILE_DEFINITIONS GDN_WITH_MPI=1
                                           INCLUDE_DIRECTORIES "${GDN_MPI_INCLUDES}")
    target_link_libraries(gdn PUBLIC ${MPI_C_LIBRARIES})
    # Open MPI's mpirun needs --allow-run-as-root/--oversubscribe in the tests (tests/dist).
    set(GDN_MPI_IS_OPENMPI OFF)
    if(MPIEXEC_EXECUTABLE)
      execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE _gdn_mpiexec_version
                      ERROR_QUIET RESULT_VARIABLE _gdn_rc)
      if(_gdn_mpiexec_version MATCHES "Open MPI|OpenRTE")
        set(GDN_MPI_IS_OPENMPI ON)
      endif()
      string(REGEX MATCH "[^\n]*" _gdn_mpiexec_version "${_gdn_mpiexec_version}")
    endif()
    message(STATUS "MPI communicator: ${MPI_C_LIBRARIES} (${MPIEXEC_EXECUTABLE}: "
                   "${_gdn_mpiexec_version})")
  endif()
endif()
if(NOT GDN_HAVE_MPI)
  message(STATUS "MPI communicator: not built (no MPI found; install libopenmpi-dev openmpi-bin)")
endif()
