# The compiler flags the build will use (_probe_flags, as CMakeLists.txt gathers them for the libstdc++ probe,
# plus the CUDA ones), checked before anything is compiled. Refused by name, as building with them makes an
# extension that cannot work:
# - a -D_GLIBCXX_USE_CXX11_ABI other than torch's (old guides to torch extensions set it to 0): the definition
#   CMake adds for torch's comes first on the command line, the user's wins, and the extension built, then
#   failed to import on an undefined symbol;
# - the fast-math family and nvcc's fast-math switches: they change the floating-point results effmem's CPU
#   and CUDA kernels share bit for bit (and its NaN and infinity handling); GCC 12 and older also link
#   crtfastmath.o into the shared library for -ffast-math, -Ofast and -funsafe-math-optimizations, which
#   flushed denormals to zero in every process that imported effmem (torch.tensor([1e-39]) * 1 gave 0).
# CMake keeps a build folder's first flags (CMAKE_CXX_FLAGS from CXXFLAGS...): the message says to delete it.
set(_cxx_flags "${_probe_flags} ${CMAKE_SHARED_LINKER_FLAGS} ${CMAKE_SHARED_LINKER_FLAGS_${_build_type}} "
               "${CMAKE_CUDA_FLAGS} ${CMAKE_CUDA_FLAGS_${_build_type}} $ENV{CUDAFLAGS}")
set(_flags_fix "Remove them (CXXFLAGS, LDFLAGS, CUDAFLAGS, CXX, or a -DCMAKE_*_FLAGS) and delete this build folder "
               "(${CMAKE_BINARY_DIR}), which keeps the flags of its first configure")
string(REGEX MATCHALL "-D_GLIBCXX_USE_CXX11_ABI=[^ ;]*" _abi_flags "${_cxx_flags}")
foreach(_abi IN LISTS _abi_flags)
  if(NOT _abi STREQUAL "-D_GLIBCXX_USE_CXX11_ABI=${EFFMEM_TORCH_CXX11_ABI}")
    message(FATAL_ERROR "effmem: the compiler flags hold ${_abi}, but torch ${EFFMEM_TORCH_VERSION} was built "
            "with _GLIBCXX_USE_CXX11_ABI=${EFFMEM_TORCH_CXX11_ABI}: the extension would not load next to it "
            "(an undefined symbol); the build sets torch's. ${_flags_fix}")
  endif()
endforeach()
# whole flags only (a path holding "-Ofast" is no flag); nvcc takes one or two dashes
set(_fast "-ffast-math|-Ofast|-funsafe-math-optimizations|-fassociative-math|-freciprocal-math")
string(APPEND _fast "|-ffinite-math-only|-fno-signed-zeros|--?use_fast_math|--?ftz=true|--?prec-(div|sqrt)=false")
string(REGEX MATCHALL "[ ;](${_fast})[ ;]" _fast_flags " ${_cxx_flags} ")
if(_fast_flags)
  string(REGEX REPLACE "[ ;]+" " " _fast_flags "${_fast_flags}")
  string(STRIP "${_fast_flags}" _fast_flags)
  message(FATAL_ERROR "effmem: the compiler flags hold ${_fast_flags}: they change the floating-point results "
          "effmem's CPU and CUDA kernels share bit for bit, and with GCC 12 or older the extension flushed "
          "denormals to zero in every process that imported it. ${_flags_fix}")
endif()
