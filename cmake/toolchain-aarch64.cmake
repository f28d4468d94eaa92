# Cross-compiles berth for aarch64 Linux on a Debian/Ubuntu x86-64 host with multiarch:
# g++-aarch64-linux-gnu plus the :arm64 -dev packages (libhwy-dev, libfmt-dev, libspdlog-dev,
# liburing-dev, libtbb-dev, libhwloc-dev, libpcre2-dev, libcpp-httplib-dev, all :arm64), whose
# headers share /usr/include and whose libraries, CMake package files and .pc files live in
# /usr/lib/aarch64-linux-gnu.
# scripts/test-arm64.sh installs all of that and runs the result under qemu-aarch64.
#
# usage: cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/toolchain-aarch64.cmake
#        -DBERTH_CUDA=OFF   (add -DBERTH_KERNELS_ONLY=ON for core, io and cpu_kernels only)
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(BERTH_CROSS_TRIPLE aarch64-linux-gnu)
set(CMAKE_C_COMPILER ${BERTH_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${BERTH_CROSS_TRIPLE}-g++)

# Multiarch layout: the sysroot is the host's /, and find_package/find_library must look only in
# the aarch64 library directory, never in /usr/lib/x86_64-linux-gnu.
set(CMAKE_LIBRARY_ARCHITECTURE ${BERTH_CROSS_TRIPLE})
set(CMAKE_FIND_ROOT_PATH /usr/${BERTH_CROSS_TRIPLE})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
set(CMAKE_IGNORE_PATH /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu
    /usr/lib/x86_64-linux-gnu/cmake /usr/include/x86_64-linux-gnu)

# pkg-config (liburing, hwloc, PCRE2, cpp-httplib): read only the aarch64 .pc files (plus the
# arch-independent ones).
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/${BERTH_CROSS_TRIPLE}/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")
set(ENV{PKG_CONFIG_SYSROOT_DIR} "")

# ctest (and add_test commands) run the binaries through qemu-user: the guest's dynamic loader and
# C/C++ runtime come from the cross toolchain's /usr/aarch64-linux-gnu, the :arm64 libraries from
# /usr/lib/aarch64-linux-gnu. The CPU model is left to QEMU_CPU (qemu's default when unset is max).
find_program(BERTH_QEMU_AARCH64 NAMES qemu-aarch64 qemu-aarch64-static)
if(BERTH_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR
      ${BERTH_QEMU_AARCH64} -L /usr/${BERTH_CROSS_TRIPLE}
      -E LD_LIBRARY_PATH=/usr/${BERTH_CROSS_TRIPLE}/lib:/usr/lib/${BERTH_CROSS_TRIPLE})
endif()
