#!/usr/bin/env bash
# The GPU checklist (../shared/GPU.md) in a few calls of the device tool, each under its
# 10-minute limit. Run from the repository root on the GPU machine, one or more phases:
#   bash scripts/gpu_session.sh check    # environment, HF parity, bf16 replay, an 8B smoke run
#   bash scripts/gpu_session.sh tests    # the gpu-marked kernel tests and tests/decoding on CUDA
#   bash scripts/gpu_session.sh kernels  # tree-attention backends on the full grid (~4 min)
#   bash scripts/gpu_session.sh train    # the README's main job (configs/long.yaml) on CUDA
#   bash scripts/gpu_session.sh rollout  # 8B-shaped oracle rollouts, batch 1-256, k 1/3/5 (~8 min)
#   bash scripts/gpu_session.sh rollout_invariant  # the same with the batch-invariant forward
#   bash scripts/gpu_session.sh kernels_b64        # issue 13's verify/decode row (batch 64, N 16)
#   bash scripts/gpu_session.sh engine   # issue 13's tables: 8B and 100M decode bound, live-KV rollout
#   bash scripts/gpu_session.sh engine2  # issue 13's tables: live-KV decode, tree proposal, long tail
#   bash scripts/gpu_session.sh fused    # the layer's fused kernels vs XLA, 8B verify steps (~5 min)
#   bash scripts/gpu_session.sh short    # one 10-minute call: 8B plain and k=3 rollouts at batch
#                                        # 1/64 vs the bound, fused vs XLA at batch 64, the gpu
#                                        # kernel tests, tests/decoding for 80 s
#   bash scripts/gpu_session.sh profile  # issue 50, ~7 min: per-kernel times (JAX's profiler) of
#                                        # the 8B decode, verify k=3, tree N=16 programs and the
#                                        # engine's loop at batch 64 and 1, host gaps, bandwidth,
#                                        # each program's HLO and estimate -> $OUT/profile_8b.json
# Every step has its own time limit, so one that hangs or fails leaves the rest running;
# each step's log goes to $OUT (or ./gpu_out) and its last lines to the console.
# Optional wheels (jax-triton, tensorboardX) in .whl/ are installed into /tmp/site first;
# the GPU image lacks both. Fetch them here (pure-Python wheels) and carry .whl:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d .whl jax-triton==0.3.1 tensorboardX==2.6.5
set -u
[ $# -gt 0 ] || { echo "usage: gpu_session.sh check|tests|kernels|train|rollout|rollout_invariant|kernels_b64|engine|engine2|fused|short|profile ..."; exit 2; }
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
start=$(date +%s)

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s, at +$(( $(date +%s) - start ))s): $*"
  timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
  echo "--- $name: exit $? after +$(( $(date +%s) - start ))s"
  grep -v -E "^\s*$|Writing model shards|it/s\]" "$out/$name.log" | tail -n "${TAIL:-25}" | cut -c1-230
}

report_env() {  # the device and the versions the figures were measured with
  {
    nvidia-smi -L; python3 -c "import sys; print(sys.version)"
    python3 -m pip list 2>/dev/null | grep -i -E "^(jax|jaxlib|jax-cuda12-plugin|jax-triton|flax|optax|orbax-checkpoint|pydantic|transformers|triton|numpy|torch|tensorboardx) "
    python3 -c "import jax; print(jax.devices()); import jaxspec.kernels as k; print('jax_triton:', k.jax_triton_available())"
  } >"$out/env.log" 2>&1
  cat "$out/env.log"
}

gpu_tests() {  # gpu_tests DECODING_LIMIT: the gpu-marked kernel tests, then tests/decoding on CUDA
  # The 10 kernel tests are one file (serial under xdist): ~98 s on an H200, mostly compiles.
  step kernel_tests 180 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider -rfE --tb=short
  # -v: each result is logged as it completes, so a time limit still leaves the names.
  TAIL=60 step decoding_tests "$1" python3 -m pytest -v -n 8 tests/decoding \
    -p no:cacheprovider --tb=line -rfE
}

# JAX takes 75% of the GPU at start-up unless told otherwise; test workers share the GPU.
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAXSPEC_TEST_PLATFORMS=cuda
for phase in "$@"; do
case $phase in
check)
  report_env
  step hf_parity 60 python3 scripts/hf_parity.py
  TAIL=40 step exactness 100 python3 scripts/bench_exactness.py --rows 512 --tokens 24 --repeats 3
  step smoke_8b 130 python3 scripts/bench_rollout.py --config configs/qwen3_8b_shape.yaml \
    --oracle 1.0 --ks 1 --batches 1 --rounds 1 --max-new-tokens 16 --json "$out/smoke_8b.json"
  ;;
tests)
  # 175 s on 8 workers covered ~3/4 of tests/decoding on an H100: give it 300 s.
  gpu_tests "${DECODING_LIMIT:-300}"
  ;;
kernels)
  TAIL=90 step kernels 260 python3 scripts/bench_kernels.py --out "$out/kernels.json"
  ;;
train)
  # The README's main job end to end on CUDA (never run on a GPU before 2026-11-24's session).
  TAIL=30 step train_long 300 python3 scripts/train_grpo.py configs/long.yaml run.dir=/tmp/gpu_long \
    run.save_every=0 model.attention_backend=auto
  ;;
rollout)
  # The oracle's drafts come from one untimed reference run per (batch, k) since issue 50
  # (--oracle-reference verify: tau = k + 1 in bf16): one more compile per (batch, k).
  TAIL=20 step rollout_8b 540 python3 scripts/bench_rollout.py --config configs/qwen3_8b_shape.yaml \
    --oracle 1.0 --ks 1,3,5 --batches 1,16,64,256 --rounds 3 --max-new-tokens 96 --bandwidth \
    --json "$out/rollout_8b.json"
  ;;
rollout_invariant)
  # The batch-invariant forward keeps bf16 speculative == plain bit for bit, so the oracle's
  # drafts stay perfect (tau = k + 1); plain and speculative both pay its slower forward.
  TAIL=20 step rollout_8b_invariant 320 python3 scripts/bench_rollout.py \
    --config configs/qwen3_8b_shape.yaml --set model.batch_invariant=true --oracle 1.0 \
    --ks 1,3,5 --batches 1,16,64 --rounds 3 --max-new-tokens 96 --bandwidth \
    --json "$out/rollout_8b_invariant.json"
  ;;
kernels_b64)
  step kernels_b64 60 python3 scripts/bench_kernels.py --backends reference,triton --batch 64 \
    --max-len 1k,8k --nodes 16 --out "$out/kernels_b64.json"
  ;;
engine)
  # Plain decode reached ~1/3 of the memory bound at 8B (docs/BENCHMARKS.md): scan vs unroll.
  # If the scan is the cause, XLA's dynamic-slice fusion (weights read in place) may cure it.
  step decode_8b 150 python3 scripts/bench_decode.py --config configs/qwen3_8b_shape.yaml \
    --batches 1,16 --rounds 5 --json "$out/decode_8b.json"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" step decode_8b_dsf 150 \
    python3 scripts/bench_decode.py --config configs/qwen3_8b_shape.yaml --batches 1 --rounds 5 \
    --json "$out/decode_8b_dsf.json"
  # small.yaml with 16 layers: issue 13's 100M policy
  sed 's/^\(  num_layers:\) 12\b.*/\1 16/' configs/small.yaml >/tmp/m100.yaml
  grep -q "^  num_layers: 16" /tmp/m100.yaml || echo "warning: /tmp/m100.yaml kept 12 layers"
  step decode_100m 90 python3 scripts/bench_decode.py --config /tmp/m100.yaml --batches 1 --rounds 5 \
    --json "$out/decode_100m.json"
  step attention_rollout 70 python3 scripts/bench_attention.py rollout --rounds 5
  ;;
engine2)  # the rest of issue 13's tables (engine alone fills a 10-minute call)
  step attention_decode 60 python3 scripts/bench_attention.py decode --rounds 5
  step attention_tree 60 python3 scripts/bench_attention.py tree --rounds 5
  step kernels_b64 60 python3 scripts/bench_kernels.py --backends reference,triton --batch 64 \
    --max-len 1k,8k --nodes 16 --out "$out/kernels_b64.json"
  step longtail 150 python3 scripts/bench_longtail.py --rollouts 256 --slots 64 --rounds 3 \
    --json "$out/longtail.json"
  ;;
fused)
  # model.fused_kernels=pallas against XLA (docs/kernels.md): slower on an H200 (2026-11-27),
  # so auto is XLA; a tuned kernel is re-timed here.
  TAIL=20 step fused_8b 400 python3 scripts/bench_fused.py --config configs/qwen3_8b_shape.yaml \
    --batches 16,64 --tokens 4,16,64 --context 2048 --rounds 5 --json "$out/fused_8b.json"
  ;;
short)
  # For a session with one call's worth of device time (15 minutes including the start):
  # the figures the GPU programs issue changed, most important first, in ~9.5 minutes.
  report_env
  TAIL=20 step rollout_8b 170 python3 scripts/bench_rollout.py --config configs/qwen3_8b_shape.yaml \
    --oracle 1.0 --ks 3 --batches 1,64 --rounds 3 --max-new-tokens 96 --bandwidth \
    --json "$out/rollout_8b.json"
  TAIL=20 step fused_8b 130 python3 scripts/bench_fused.py --config configs/qwen3_8b_shape.yaml \
    --batches 64 --tokens 4,16 --context 2048 --rounds 3 --json "$out/fused_8b.json"
  gpu_tests "${DECODING_LIMIT:-80}"
  ;;
profile)
  # Issue 50: where the 8B verify's 2.67x-its-floor time goes. Cases run by priority (batch
  # 64 first) until --budget-s; the JSON is rewritten after each, so a limit keeps the rest.
  report_env
  TAIL=40 step profile_8b 450 python3 scripts/gpu_profile.py --config configs/qwen3_8b_shape.yaml \
    --batches 64,1 --context 2048 --calls 3 --new-tokens 32 --budget-s 360 \
    --json "$out/profile_8b.json" --hlo-dir "$out/profile_hlo" --trace-dir "$out/profile_trace"
  gzip -f "$out"/profile_hlo/*.hlo.txt "$out"/profile_trace/*.xplane.pb 2>/dev/null
  ;;
*) echo "unknown phase $phase: check | tests | kernels | train | rollout | rollout_invariant | kernels_b64 | engine | engine2 | fused | short | profile"; exit 2 ;;
esac
done
echo "total +$(( $(date +%s) - start ))s"
