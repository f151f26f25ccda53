#!/usr/bin/env bash
# The prepared run for a lent GPU machine (one H200, no registry access, nothing installed from
# here; it needs only torch, transformers and numpy, which its image has). Fits 9 minutes of wall
# time (60 + 210 + 230 + 40 s); parts in order of value, each with its own time limit, each writing as it goes:
#   0. the HF backend's and the replay's tests, CUDA ones included (they skip on a CPU);
#   a. the embedded pair (Qwen2.5-Coder 1.5B target / 0.5B drafter), its real greedy decisions
#      replayed on random-weight models of its architectures (benchmarks/real_pair.py --replay,
#      docs/results.md section 2) on the one GPU: non-SI, SI and DSI with SP 1, 2, 4 (k = 5 and
#      event-driven windows), target servers as processes of their own (own interpreter and CUDA
#      context) and as threads of one process (the first H200 run, docs/results.md section 6: k = 2-3
#      lost to SI under time-slicing, k = 4-5 won; the event-driven windows size themselves);
#   b. the same decisions on a Qwen2.5-14B target architecture (48 layers; random weights built
#      on the GPU in bf16) with the 0.5B drafter: a realistic drafter/target latency ratio. SP up
#      to 3 processes (4 copies of 29.5 GB with the driver's own) and 4 threads (one shared copy);
#   c. every SI and DSI row of a and b carries engine/ideal (the event simulator fed by latencies
#      measured alone in the same run), the target forward and drafter step as they ran, and the
#      GPU's utilisation during the timed runs;
#   e. draft trees (issue 24): what verifying a tree of 4-64 nodes in one forward (the tree attention
#      mask) costs against one token, a chain of as many tokens, and a forward per path, on the 1.5B
#      target's architecture (benchmarks/tree_forward_cost.py).
# Part d, the 16-core CPU question, is benchmarks/gpu_check_cpu.sh: a second run of the same length.
#
# Usage, from the repository root:  bash benchmarks/gpu_check.sh     (writes to $OUT or results/)
# DRY_RUN=1 runs every part on the CPU with tiny configurations of the same architectures and a
# few tokens (tests/integration/test_gpu_check.py does, so this script cannot rot between runs).
# REPEATS overrides the repeats per prompt (default 2).
set -uo pipefail
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out="${OUT:-results}"
mkdir -p "$out"
recording=benchmarks/recordings/qwen2.5-coder-code-64.json
if [ -n "${DRY_RUN:-}" ]; then
    configs="$(mktemp -d)"
    python3 benchmarks/tiny_configs.py "$configs" || exit 1
    device=cpu dtype=fp32 limit_tests=0 limit_a=240 limit_b=240 limit_e=120
    trees=(--configs-dir "$configs" --sizes 4 8 --repeats 1)
    common=(--configs-dir "$configs" --tokens 8 --prompts 2 --repeats 1)
    a_dsi=(--dsi processes:3,auto:1,2 --dsi threads:3:1) b_dsi=(--dsi processes:2:1 --dsi threads:2,auto:1,2)
    si_a=(--si-k 4) si_b=(--si-k 3)
else
    device=cuda:0 dtype=bf16 limit_tests=60 limit_a=210 limit_b=230 limit_e=40
    trees=(--repeats 5)
    common=(--repeats "${REPEATS:-2}")
    a_dsi=(--dsi processes:5,auto:1,2,4 --dsi threads:5:1,2,4) b_dsi=(--dsi processes:4,auto:1,2,3 --dsi threads:4:1,2,4)
    si_a=(--si-k 4 6) si_b=(--si-k 3 5)
fi

python3 - <<'PY' 2>&1 | tee "$out/machine.txt"
import os, platform, subprocess, torch, transformers, numpy
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__,
      "numpy", numpy.__version__, "cpus", os.cpu_count())
print("cuda", torch.cuda.is_available(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    print(f"gpu memory free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")
    try:
        print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                              "--format=csv"], capture_output=True, text=True, timeout=20).stdout.strip())
    except Exception as exc:
        print("nvidia-smi:", exc)
PY

status=0
if [ "$limit_tests" -gt 0 ]; then
    timeout "$limit_tests" python3 -m pytest -q -p no:cacheprovider tests/unit/models/test_hf.py \
        tests/unit/models/test_replay.py 2>&1 | tee "$out/tests.log" || status=1
fi

part() {  # part NAME LIMIT ARGS...: one real_pair.py run, cut off at LIMIT s (it stops starting
    local name=$1 limit=$2  # new configurations 60 s before that, so its table still prints)
    shift 2
    timeout "$limit" python3 benchmarks/real_pair.py --replay "$recording" --device "$device" --dtype "$dtype" \
        --target-devices "$device" --deadline $((limit - 60 > 10 ? limit - 60 : 10)) "${common[@]}" "$@" \
        --out "$out/$name.json" 2>&1 | grep -v "Loading weights" | tee "$out/$name.log"
}
part pair "$limit_a" "${si_a[@]}" "${a_dsi[@]}" || status=1
part target14b "$limit_b" --target-config qwen2.5-14b-instruct "${si_b[@]}" "${b_dsi[@]}" || status=1
timeout "$limit_e" python3 benchmarks/tree_forward_cost.py --config qwen2.5-coder-1.5b-instruct --device "$device" \
    --dtype "$dtype" "${trees[@]}" --out "$out/trees.json" 2>&1 | grep -v "Loading weights" | tee "$out/trees.log" \
    || status=1
echo "gpu_check exit $status"
exit $status
