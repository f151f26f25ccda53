#!/usr/bin/env bash
# One prepared run for a lent GPU machine (no registry access, nothing installed from here):
#   1. the HF backend's tests, CUDA ones included (they skip on a CPU-only machine);
#   2. the embedded pair replayed on random-weight models of its architecture on the GPU
#      (benchmarks/real_pair.py --replay; see docs/results.md, section 2): non-SI, SI and DSI with
#      SP 1 and 2 on the one GPU, every accept/reject the real pair's.
# Usage, from the repository root:  bash benchmarks/gpu_check.sh      (writes to $OUT or results/)
# DEVICE, REPEATS, SI_K, DSI_K and SP override the defaults (DEVICE=cpu for a dry run).
set -uo pipefail
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out="${OUT:-results}"
mkdir -p "$out"
device="${DEVICE:-cuda:0}"
python3 - <<'PY' 2>&1 | tee "$out/machine.txt"
import platform, torch, transformers
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__)
print("cuda", torch.cuda.is_available(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/models/test_hf.py tests/unit/models/test_replay.py \
    2>&1 | tee "$out/tests.log"
tests=$?
# shellcheck disable=SC2086
timeout 420 python3 benchmarks/real_pair.py --replay benchmarks/recordings/qwen2.5-coder-code-64.json \
    --device "$device" --target-devices $device $device --repeats "${REPEATS:-3}" \
    --si-k ${SI_K:-4 6 8} --dsi-k ${DSI_K:-3 5 8} --dsi-sp ${SP:-1 2} \
    --out "$out/real_pair_replay.json" 2>&1 | grep -v "Loading weights" | tee "$out/real_pair_replay.log"
bench=$?
echo "tests exit $tests, benchmark exit $bench"
exit $(( tests != 0 || bench != 0 ))
