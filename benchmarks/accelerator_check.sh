#!/usr/bin/env bash
# Accelerator check: the DP step's overhead and a short pretrain on whatever
# accelerator TensorFlow sees, each under a timeout, printing the ratios.
#
#   benchmarks/accelerator_check.sh            # GPUs (MirroredStrategy over all of them) or CPU
#   TIMEOUT_S=600 benchmarks/accelerator_check.sh
#   TPU=local benchmarks/accelerator_check.sh  # on a TPU VM (TPUStrategy)
#   MODEL=pico STEPS=2 MICRO_BATCH=8 BATCH=16 benchmarks/accelerator_check.sh   # a smoke run
#
# Prints, per clipping, the step-overhead ratios dp_step / nonprivate_step
# for time and peak memory (benchmarks/step_overhead.py), then the wall time
# of a short BERT-mini `tf-megadp pretrain` private and non-private on the
# same data and the ratio private / non-private. Exit status: 0 when every
# part finished, 124 when one ran past its timeout, else the failing part's.
set -uo pipefail

cd "$(dirname "$0")/.."
TIMEOUT_S="${TIMEOUT_S:-900}"
OUT="${OUT_DIR:-$(mktemp -d)}"
export TF_CPP_MIN_LOG_LEVEL=3
status=0

devices=$(timeout 300 python -c '
import tensorflow as tf
gpus = tf.config.list_physical_devices("GPU")
print(len(gpus), " ".join(d.name for d in gpus))' 2>/dev/null | tail -1)
gpus="${devices%% *}"
echo "accelerator check: GPUs seen by TensorFlow: ${devices:-0}; TPU=${TPU:-none}; output ${OUT}"
if [[ -n "${TPU:-}" ]]; then
    strategy=(--strategy tpu --tpu "${TPU}")
    where="TPU ${TPU}"
elif [[ "${gpus:-0}" -gt 1 ]]; then
    strategy=(--strategy mirrored)
    where="${gpus} GPUs (MirroredStrategy)"
elif [[ "${gpus:-0}" -eq 1 ]]; then
    strategy=()
    where="1 GPU"
else
    strategy=()
    where="CPU only (no accelerator seen)"
fi
echo "running on: ${where}"

echo "== step overhead (tiny BERT, m = 64) =="
timeout "${TIMEOUT_S}" python benchmarks/step_overhead.py --sizes tiny --micro-batch 64 \
    --paths train_on_batch --clipping ghost,vectorized --repeats 10 || status=$?

# m is per replica; B = 1024 keeps k = 2 micro-steps on up to 8 replicas.
MODEL="${MODEL:-mini}"; STEPS="${STEPS:-20}"; MICRO_BATCH="${MICRO_BATCH:-64}"; BATCH="${BATCH:-1024}"
pretrain=(python tf_megadp_cli.py pretrain --model "${MODEL}" --sequence-length 128
          --micro-batch-size "${MICRO_BATCH}" --batch-size "${BATCH}" --steps "${STEPS}"
          --eval-every "${STEPS}" --max-characters 2000000 --cache-dir "${OUT}/cache"
          "${strategy[@]}")
echo "== short pretrain: BERT-${MODEL}, ${STEPS} logical steps of B = ${BATCH}, private =="
timeout "${TIMEOUT_S}" "${pretrain[@]}" --noise-multiplier 1.0 \
    --output-dir "${OUT}/private" || status=$?
echo "== the same, non-private baseline =="
timeout "${TIMEOUT_S}" "${pretrain[@]}" --non-private \
    --output-dir "${OUT}/baseline" || status=$?

python - "${OUT}" <<'PY' || status=$?
import json, os, sys
out = sys.argv[1]
reports = {}
for name in ("private", "baseline"):
    path = os.path.join(out, name, "report.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as stream:
            reports[name] = json.load(stream)
if len(reports) < 2:
    sys.exit(f"pretrain ratio: missing reports ({', '.join(reports) or 'none'} finished)")
private, baseline = reports["private"], reports["baseline"]
print(f"pretrain train time: private {private['train_time_s']:.1f} s, non-private "
      f"{baseline['train_time_s']:.1f} s, ratio {private['train_time_s'] / baseline['train_time_s']:.2f}; "
      f"examples/s {private['examples_per_s']:.0f} vs {baseline['examples_per_s']:.0f}; "
      f"epsilon {private['epsilon']:.3f}")
PY
echo "accelerator check finished with status ${status}"
exit "${status}"
