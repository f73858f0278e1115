#!/bin/bash
# kvrelay against vLLM-CPU on the same cores, one after the other, driven by vLLM's own client
# (`vllm bench serve`), as BENCHMARKS.md "Serving against vLLM-CPU on the same 2 cores" records.
#
#   VLLM_VENV=/path/to/vllm-venv cluster/bench/vs_vllm.sh chat|long OUTDIR [--avx2]
#   KVRELAY_SPECS="deploy/local.yaml deploy/colocated-gguf.yaml" ... (other kvrelay specs, each served
#   and measured in turn after vLLM; default: deploy/local.yaml deploy/colocated.yaml)
#
# vLLM is not a dependency of kvrelay: install vllm-cpu into a venv of its own (remove the
# torchvision/torchaudio/torchcodec it pulls in, which do not load against the CPU torch).
#   chat: 16 requests of 128 in / 128 out at max rate
#   long: 20 requests at 0.5/s, prompts uniform in ~25-1000 tokens, 128 out (seed 7)
# --avx2 runs both as on an AVX2-only CPU (a Zen 3), on a CPU that also has AVX-512: vLLM-CPU
# loads its own AVX2 build (vllm._C_AVX2, chosen where torch reports no AVX-512; a sitecustomize
# written to OUTDIR tells it so), torch and oneDNN are held to AVX2 in both servers
# (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), and kvrelay's stages run `kernel_isa: avx2`.
# Memory and caches stay this CPU's.
set -u
KIND=${1:?chat or long}; OUT=${2:?output folder}; AVX2=${3:-}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
V=${VLLM_VENV:?the vllm-cpu venv}/bin
K=$ROOT/.venv/bin
# the default model as a checkpoint folder (converted from its GGUF once, cached)
MODEL=${VLLM_MODEL:-$(cd "$ROOT" && $K/python -c "from engine.weights import resolve_model; print(resolve_model(None))")}
mkdir -p "$OUT"
case $KIND in
  chat) LOAD="--random-input-len 128 --random-output-len 128 --num-prompts 16 --request-rate inf" ;;
  long) LOAD="--random-input-len 512 --random-range-ratio 0.95 --random-output-len 128 --num-prompts 20
              --request-rate 0.5 --seed 7" ;;
  *) echo "usage: $0 chat|long OUTDIR [--avx2]" >&2; exit 2 ;;
esac
SPECS=""
for s in ${KVRELAY_SPECS:-deploy/local.yaml deploy/colocated.yaml}; do SPECS="$SPECS $(cd "$ROOT" && realpath "$s")"; done
VLLM_ENV=()
if [ "$AVX2" = --avx2 ]; then
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
  mkdir -p "$OUT/avx2site"
  printf 'import torch.cpu\ntorch.cpu._is_avx512_supported = lambda: False\ntorch.cpu._is_avx512_bf16_supported = lambda: False\n' \
    > "$OUT/avx2site/sitecustomize.py"
  VLLM_ENV=(PYTHONPATH="$OUT/avx2site")
  AVX2_SPECS=""
  for s in $SPECS; do  # the same specs, every stage on the avx2 kernels
    sed -E 's/^(prefill|decode|colocated):$/&\n  kernel_isa: avx2/' "$s" > "$OUT/$(basename "$s" .yaml)-avx2.yaml"
    AVX2_SPECS="$AVX2_SPECS $OUT/$(basename "$s" .yaml)-avx2.yaml"
  done
  SPECS=$AVX2_SPECS
fi
bench() {  # port served-name label
  # shellcheck disable=SC2086
  $V/vllm bench serve --backend openai --base-url "http://127.0.0.1:$1" --endpoint /v1/completions \
    --model "$MODEL" --served-model-name "$2" --tokenizer "$MODEL" --dataset-name random $LOAD --ignore-eos \
    --save-result --result-dir "$OUT" --result-filename "$3.json" > "$OUT/$3.txt" 2>&1
  grep -E "Output token throughput|Median TPOT|P99 TPOT|Median TTFT|P99 TTFT|Successful|Failed" "$OUT/$3.txt" |
    sed "s/^/$3: /"
}
wait_port() { for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }
echo "$(grep -m1 'model name' /proc/cpuinfo); flags: $(grep -o -w -E 'avx512_bf16|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "load before: $(cut -d' ' -f1 /proc/loadavg)"
env "${VLLM_ENV[@]}" VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 $V/vllm serve "$MODEL" --dtype float32 \
  --port 8100 --max-model-len 2048 > "$OUT/vllm-serve.log" 2>&1 &
VP=$!
if wait_port 8100; then
  bench 8100 "$MODEL" vllm
  for p in $(pgrep -f "VLLM::Worker"); do  # which of vLLM's kernel builds its worker runs
    grep -o -m1 -E "vllm/_C(_AVX2|_AVX512)?\.abi3\.so" "/proc/$p/maps" | sed "s/^/vllm worker $p loaded: /"
  done
fi
kill -INT $VP; wait $VP 2>/dev/null; sleep 3
for spec in $SPECS; do
  name=$(basename "$spec" .yaml)
  (cd "$ROOT" && $K/kvrelay serve "$spec" > "$OUT/kvrelay-$name.log" 2>&1) &
  KP=$!
  if wait_port 8000; then
    bench 8000 SmolLM2-135M-Instruct "kvrelay-$name"
    (cd "$ROOT" && $K/kvrelay status) > "$OUT/status-$name.txt" 2>&1  # names each replica's weights/kernels
  fi
  pkill -INT -f "kvrelay serve $spec"; wait $KP 2>/dev/null; sleep 3
done
echo "load after: $(cut -d' ' -f1 /proc/loadavg)"
