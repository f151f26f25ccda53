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
