# Every dependency comes from a Debian package (scripts/setup.sh installs the missing ones);
# nothing is downloaded at build time.
find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(fmt REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(CLI11 REQUIRED)
find_package(GTest REQUIRED)
if(GDN_BENCH)
  find_package(benchmark REQUIRED)
endif()
set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)
find_path(GDN_CBLAS_INCLUDE cblas.h PATHS /usr/include/x86_64-linux-gnu/openblas-pthread
          /usr/include/openblas /usr/include/x86_64-linux-gnu /usr/include REQUIRED)

add_library(gdn_deps INTERFACE)
target_link_libraries(gdn_deps INTERFACE fmt::fmt nlohmann_json::nlohmann_json CLI11::CLI11
                      OpenMP::OpenMP_CXX ${BLAS_LIBRARIES} Threads::Threads)
target_include_directories(gdn_deps INTERFACE ${GDN_CBLAS_INCLUDE})
