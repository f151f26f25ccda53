# Build llama-cpp-python with only what dsi loads: libllama and the ggml libraries.
#
# Used through CMAKE_ARGS="-DCMAKE_PROJECT_llama_cpp_INCLUDE=<this file>" (README, .ci/run): CMake
# includes it at the end of llama-cpp-python's project(llama_cpp) call, before that file's options.
#
# - LLAVA_BUILD OFF: no multimodal library (tools/mtmd), which dsi never loads (llama-cpp-python
#   imports it only for its multimodal chat handlers).
# - LLAMA_BUILD_COMMON OFF: no llama.cpp "common" library (argument parsing, chat parsers, downloads,
#   cpp-httplib), which only llama.cpp's own tools and mtmd use. llama-cpp-python 0.3.36 forces the
#   cache entry ON (set(... CACHE BOOL "" FORCE)), which -D cannot undo; a normal variable of the same
#   name shadows it (CMake policy CMP0126, NEW from the cmake_minimum_required(VERSION 3.21) of
#   llama-cpp-python's CMakeLists, and llama.cpp's option() keeps a normal variable: CMP0077).
#
# Together they are about two thirds of the compile (measured in docs/results.md, section 10).
set(LLAVA_BUILD OFF)
set(LLAMA_BUILD_COMMON OFF)
#
# - No AMX kernels on x86: with GGML_NATIVE (the default) a CPU with AMX (Intel Sapphire Rapids and
#   later) gets ggml's AMX backend, which repacks Q4_K/Q6_K/Q8_0 weights into AMX buffers and then
#   segfaults in ggml_backend_amx_mul_mat on the first forward of the embedded Q4_K_M pair (seen on this
#   project's machine on 2026-12-02, and upstream: ggml-org/llama.cpp issue 20824). The AMX code is
#   compiled only when the compiler targets AMX-INT8, so -mno-amx-* removes it and leaves every other
#   native instruction (AVX-512, VNNI) and the CPU repacking in place. dsi also refuses AMX buffers at
#   run time in a build that has them (dsi.models.llamacpp).
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64|i[3-6]86)$")
    include(CheckCXXCompilerFlag)
    check_cxx_compiler_flag("-mno-amx-int8" DSI_HAS_NO_AMX_FLAG)
    if(DSI_HAS_NO_AMX_FLAG)
        add_compile_options(-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
    endif()
endif()
