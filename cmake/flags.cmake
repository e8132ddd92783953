# The compiler settings the user's environment gives, checked before anything is compiled.
#
# CMake reads CXX, CXXFLAGS and LDFLAGS (CUDAHOSTCXX and CUDAFLAGS when CUDA is enabled) at a build folder's
# first configure only, and keeps them in its cache: unset or changed later, they stuck to the reused folder
# (pip's build/<wheel tag>) without a word. They are recorded here at the first configure, and a later one
# given other values stops, naming the variable and the folder to delete, as CUDA_HOME's check does.
foreach(_var CXX CXXFLAGS LDFLAGS CUDAHOSTCXX CUDAFLAGS)
  if(NOT DEFINED EFFMEM_ENV_${_var})
    set(EFFMEM_ENV_${_var} "$ENV{${_var}}" CACHE INTERNAL "${_var} at this build folder's first configure")
  elseif(NOT "$ENV{${_var}}" STREQUAL "${EFFMEM_ENV_${_var}}")
    message(FATAL_ERROR "${_var} is now '$ENV{${_var}}', but this build folder (${CMAKE_BINARY_DIR}) was "
            "configured with ${_var}='${EFFMEM_ENV_${_var}}', which CMake keeps; delete the folder to build with "
            "the new setting")
  endif()
endforeach()

# Flags that build an extension which cannot work, refused by name before the build:
# - -D_GLIBCXX_USE_CXX11_ABI other than torch's (old guides to torch extensions set it to 0): the definition
#   CMake adds for torch's comes first on the command line, the user's wins, and the extension built, then
#   failed to import on an undefined symbol;
# - -ffast-math, -Ofast and -funsafe-math-optimizations: GCC links crtfastmath.o into the shared library too,
#   which flushes denormals to zero in every process that imports effmem (torch's results change), and the
#   kernels lose the rounding the CPU and CUDA paths share bit for bit; likewise nvcc's fast-math switches.
string(TOUPPER "${CMAKE_BUILD_TYPE}" _flags_type)
set(_cxx_flags "${CMAKE_CXX_COMPILER_ARG1} ${CMAKE_CXX_FLAGS} ${CMAKE_CXX_FLAGS_${_flags_type}} "
               "${CMAKE_SHARED_LINKER_FLAGS} ${CMAKE_MODULE_LINKER_FLAGS} $ENV{CUDAFLAGS}")
string(REGEX MATCHALL "-D_GLIBCXX_USE_CXX11_ABI=[^ ;]*" _abi_flags "${_cxx_flags}")
foreach(_abi IN LISTS _abi_flags)
  if(NOT _abi STREQUAL "-D_GLIBCXX_USE_CXX11_ABI=${EFFMEM_TORCH_CXX11_ABI}")
    message(FATAL_ERROR "effmem: the compiler flags hold ${_abi}, but torch ${EFFMEM_TORCH_VERSION} was built "
            "with _GLIBCXX_USE_CXX11_ABI=${EFFMEM_TORCH_CXX11_ABI}: the extension would not load next to it "
            "(an undefined symbol). Remove it from CXXFLAGS (the build sets torch's)")
  endif()
endforeach()
set(_fast "-ffast-math|-Ofast|-funsafe-math-optimizations|-+use_fast_math|--ftz=true|--prec-div=false")
string(REGEX MATCHALL "(${_fast}|--prec-sqrt=false)" _fast_flags "${_cxx_flags}")
if(_fast_flags)
  list(REMOVE_DUPLICATES _fast_flags)
  list(JOIN _fast_flags " " _fast_flags)
  message(FATAL_ERROR "effmem: the compiler flags hold ${_fast_flags} (CXXFLAGS, LDFLAGS, CXX or "
          "CUDAFLAGS): such an extension flushes denormals to zero in every process that imports it (GCC links "
          "crtfastmath.o), changing torch's results, and its kernels lose the rounding effmem's CPU and CUDA "
          "paths share bit for bit. Remove them for this build")
endif()
