#!/usr/bin/env bash
# llama.cpp's llama-server, built from the vendor/llama.cpp tree of the llama-cpp-python
# source package on PyPI (cmake, about 4 minutes on 2 cores) into $PEERS_CACHE/llama.cpp, with
# llama-quantize (benchmarks/gguf_models.py writes the K-quant files with it);
# serves the default GGUF file itself with -np 8 -c 8192 -t 2.
PEER=llama.cpp
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
LCP_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DIR="$PEERS_CACHE/llama.cpp"
BIN="$DIR/build/bin/llama-server"
QUANTIZE_BIN="$DIR/build/bin/llama-quantize"

# GGML_NATIVE=ON built instructions this VM's CPU reports but cannot run ("Illegal
# instruction" at start): build for AVX2/FMA, plus the AVX-512 extensions /proc/cpuinfo
# lists (an explicit AVX-512 build runs here; without it llama.cpp loses its AVX-512 paths).
CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  CPU_FLAGS+=(-DGGML_AVX512=ON)
  for ext in vnni bf16 vbmi; do
    grep -qw "avx512_$ext\|avx512$ext" /proc/cpuinfo && CPU_FLAGS+=("-DGGML_AVX512_${ext^^}=ON")
  done
else
  CPU_FLAGS+=(-DGGML_AVX512=OFF)
fi
STAMP="$DIR/build/.arborlm-cpu-flags"

install() {
  if [[ -x "$BIN" && "$(cat "$STAMP" 2>/dev/null)" == "${CPU_FLAGS[*]}" ]]; then
    # a build of an earlier version of this script: add llama-quantize (incremental, the libraries are built)
    [[ -x "$QUANTIZE_BIN" ]] || cmake --build "$DIR/build" --target llama-quantize -j "$(nproc)" \
      || skip "build of llama-quantize failed"
    return
  fi
  command -v cmake >/dev/null || skip "cmake is missing (apt-get install cmake)"
  command -v c++ >/dev/null || skip "no C++ compiler (apt-get install g++)"
  log "building llama-server from llama-cpp-python==$LCP_VERSION into $DIR"
  rm -rf "$DIR/sdist" "$DIR/src" && mkdir -p "$DIR/sdist" "$DIR/src"
  "$ARBORLM_PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LCP_VERSION" -d "$DIR/sdist" \
    || skip "could not download the llama-cpp-python==$LCP_VERSION source package"
  tar -xzf "$DIR"/sdist/llama_cpp_python-*.tar.gz -C "$DIR/src" --strip-components=1 || skip "bad source package"
  [[ -f "$DIR/src/vendor/llama.cpp/CMakeLists.txt" ]] || skip "no vendor/llama.cpp in the source package"
  # No network at build or run time: no curl/openssl downloads, no web UI assets.
  cmake -S "$DIR/src/vendor/llama.cpp" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    "${CPU_FLAGS[@]}" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_WEBUI=OFF -DLLAMA_USE_PREBUILT_WEBUI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    || skip "cmake configure failed"
  cmake --build "$DIR/build" --target llama-server llama-quantize -j "$(nproc)" \
    || skip "build of llama-server failed"
  [[ -x "$BIN" && -x "$QUANTIZE_BIN" ]] || skip "no $BIN or $QUANTIZE_BIN after the build"
  echo "${CPU_FLAGS[*]}" > "$STAMP"
}

case "${1:-}" in
  install) install ;;
  start)
    port="${2:?port}"
    # shellcheck disable=SC2086  # LLAMA_SERVER_EXTRA_ARGS is a list of flags
    exec "$BIN" -m "$(model_gguf)" --host 127.0.0.1 --port "$port" -np 8 -c 8192 -t 2 ${LLAMA_SERVER_EXTRA_ARGS:-} ;;
  *) echo "usage: $0 install | start PORT" >&2; exit 2 ;;
esac
