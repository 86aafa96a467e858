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
# Real text (src/text): PCRE2 (regex with lookahead and Unicode classes, JIT), utf8proc (NFC),
# zlib and zstd (compressed corpora).
find_package(PkgConfig REQUIRED)
pkg_check_modules(GDN_TEXT_LIBS REQUIRED IMPORTED_TARGET libpcre2-8 libutf8proc zlib libzstd)
find_path(GDN_CBLAS_INCLUDE cblas.h PATHS /usr/include/x86_64-linux-gnu/openblas-pthread
          /usr/include/openblas /usr/include/x86_64-linux-gnu /usr/include REQUIRED)

add_library(gdn_deps INTERFACE)
target_link_libraries(gdn_deps INTERFACE fmt::fmt nlohmann_json::nlohmann_json CLI11::CLI11
                      OpenMP::OpenMP_CXX ${BLAS_LIBRARIES} Threads::Threads
                      PkgConfig::GDN_TEXT_LIBS)
target_include_directories(gdn_deps INTERFACE ${GDN_CBLAS_INCLUDE})
