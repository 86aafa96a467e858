# gdntrain._C, the Python extension module (python/src, docs/PYTHON.md), built with nanobind.
#   GDN_PYTHON=AUTO (default): built when build/pyenv (scripts/pyenv.sh) has nanobind, so that the
#     normal build and ctest cover it without a second build; ON: required; OFF: never.
#   Under scikit-build-core (`pip install .`, `pip wheel .`) it is always built and installed into
#   the wheel's gdntrain package, next to python/gdntrain/*.py.
set(GDN_PYTHON AUTO CACHE STRING "Build the Python extension gdntrain._C (AUTO, ON, OFF)")
set(GDN_PYENV ${PROJECT_SOURCE_DIR}/build/pyenv)
set(GDN_HAVE_PYTHON OFF)
if(SKBUILD)
  set(GDN_PYTHON ON)
elseif(GDN_PYTHON STREQUAL AUTO)
  if(EXISTS ${GDN_PYENV}/bin/python)
    execute_process(COMMAND ${GDN_PYENV}/bin/python -c "import nanobind" RESULT_VARIABLE rc
                    OUTPUT_QUIET ERROR_QUIET)
    if(rc EQUAL 0)
      set(GDN_PYTHON ON)
      set(Python_EXECUTABLE ${GDN_PYENV}/bin/python)
    endif()
  endif()
  if(NOT GDN_PYTHON STREQUAL ON)
    message(STATUS "gdntrain._C: not built (build/pyenv with nanobind is missing: scripts/setup.sh)")
  endif()
elseif(GDN_PYTHON AND NOT DEFINED Python_EXECUTABLE AND EXISTS ${GDN_PYENV}/bin/python)
  set(Python_EXECUTABLE ${GDN_PYENV}/bin/python)
endif()

if(GDN_PYTHON)
  find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)
  execute_process(COMMAND ${Python_EXECUTABLE} -m nanobind --cmake_dir
                  OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE nanobind_ROOT)
  find_package(nanobind CONFIG REQUIRED)
  set(GDN_PY_SOURCES ${PROJECT_SOURCE_DIR}/python/src/module.cpp)
  if(GDN_CUDA)
    list(APPEND GDN_PY_SOURCES ${PROJECT_SOURCE_DIR}/python/src/stream_cuda.cu)
  else()
    list(APPEND GDN_PY_SOURCES ${PROJECT_SOURCE_DIR}/python/src/stream_cpu.cpp)
  endif()
  nanobind_add_module(_C NB_STATIC ${GDN_PY_SOURCES})
  gdn_link_whole(_C)
  target_include_directories(_C PRIVATE ${PROJECT_SOURCE_DIR}/python/src)
  # nanobind's own sources and headers are not held to the project's warning flags.
  target_compile_options(_C PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-shadow -Wno-pedantic>)
  # Next to the package sources' layout: build/<preset>/python/gdntrain/_C*.so, so that tests put
  # build/<preset>/python and python/ on PYTHONPATH (gdntrain/__init__.py finds _C in either).
  set_target_properties(_C PROPERTIES LIBRARY_OUTPUT_DIRECTORY
                                      ${PROJECT_BINARY_DIR}/python/gdntrain)
  set(GDN_HAVE_PYTHON ON)
  if(SKBUILD)
    install(TARGETS _C LIBRARY DESTINATION gdntrain COMPONENT python)
  endif()
endif()
