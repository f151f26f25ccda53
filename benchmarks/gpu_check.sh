#!/usr/bin/env bash
# The prepared run for a lent GPU machine (an H100 or an H200: machine.txt says which; no registry
# access, nothing installed from here; it needs only torch, transformers and numpy, which its image
# has). Fits 9 minutes of wall time (45 + 35 + 75 + 120 + 150 + 120 s and the start); parts in order of
# value, each with its own time limit, each writing as it goes:
#   0. the HF backend's tests (dynamic and static caches, graphs' shapes; on CUDA, graphs captured by
#      sessions in four threads at once against the CPU's rows), the replay's and the device decisions'
#      (tests/unit/models/test_device_laws.py, every method with and without graphs), CUDA ones included
#      (they skip on a CPU);
#   f. forwards (benchmarks/gpu_forwards.py): the 0.5B drafter, the 1.5B and the 14B target
#      architectures (random weights, bf16), one token and a k = 4 verification, eager on the dynamic
#      cache, eager on the static cache and as captured CUDA graphs, against the weights' read time
#      at the copy bandwidth measured in the same run; the first forwards give the capture time; and a
#      sampled and a penalised greedy verification, and a drafter step with its draw, decided on the
#      host and on the device (device_laws.py);
#   a. the embedded pair (Qwen2.5-Coder 1.5B target / 0.5B drafter), its real greedy decisions
#      replayed on random-weight models of its architectures (benchmarks/real_pair.py --replay,
#      docs/results.md#real-models-on-a-cpu) with CUDA graphs: non-SI, SI (k = 4) and DSI (event-driven windows)
#      with SP 1, 2, 4, target servers as processes (own interpreter and CUDA context) and as threads
#      of one process (one graph launch a forward holds the GIL for microseconds);
#   b. the same decisions on a Qwen2.5-14B target architecture (48 layers; random weights built on the
#      GPU in bf16) with the 0.5B drafter, with graphs: SP up to 3 processes (copies of 29.5 GB: the
#      free memory decides) and 4 threads (one shared copy);
#   c. b's configurations without graphs (eager, dynamic cache): the baseline, in the same run.
#   Every SI and DSI row carries engine/ideal (the event simulator fed by latencies measured alone in
#   the same run), the target forward and drafter step as they ran, and the GPU's utilisation.
# Part d, the 16-core CPU question, is benchmarks/gpu_check_cpu.sh: a second run of the same length.
# The tree forwards (issue 24) are benchmarks/tree_forward_cost.py, recorded in docs/results.md.
#
# Files (at most 8 come back from a lent machine): machine.txt, run.log (every part's output, in order),
# forwards.json, pair_graphs.json, target14b_graphs.json, target14b.json and report.md
# (benchmarks/gpu_report.py: the tables for docs/results.md and issue 51's goals; run it again on the files
# brought back if the run was cut off before it).
#
# Usage, from the repository root:  bash benchmarks/gpu_check.sh     (writes to $OUT or results/)
# DRY_RUN=1 runs every part on the CPU with tiny configurations of the same architectures and a
# few tokens (tests/integration/test_gpu_check.py does, so this script cannot rot between runs).
# REPEATS overrides the repeats per prompt (default 2).
set -uo pipefail
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out="${OUT:-results}"
mkdir -p "$out"
log="$out/run.log"
: > "$log"
recording=benchmarks/recordings/qwen2.5-coder-code-64.json
if [ -n "${DRY_RUN:-}" ]; then
    configs="$(mktemp -d)"
    python3 benchmarks/tiny_configs.py "$configs" || exit 1
    device=cpu dtype=fp32 limit_tests=0 limit_f=120 limit_a=240 limit_b=240 limit_c=240
    forwards=(--configs-dir "$configs" --repeats 2 --copy-gb 0.05)
    common=(--configs-dir "$configs" --tokens 8 --prompts 2 --repeats 1)
    a_dsi=(--dsi processes:auto:1,2 --dsi threads:auto:1) b_dsi=(--dsi processes:auto:1 --dsi threads:auto:1,2)
    si=(--si-k 3)
else
    device=cuda:0 dtype=bf16 limit_tests=45 limit_f=75 limit_a=120 limit_b=150 limit_c=120
    forwards=(--repeats 20)
    common=(--repeats "${REPEATS:-2}")
    # 14B copies that fit (27.5 GiB each, 32 with its cache and activations): the driver's own, and one per
    # server process beside it (an H200's 140 GiB: 3 processes; an H100's 80 GiB: 1); threads share the driver's
    copies=$(python3 -c "import torch; print(int(torch.cuda.mem_get_info()[0] / 2**30 // 32) if torch.cuda.is_available() else 1)")
    b_servers=$(( copies - 1 < 3 ? copies - 1 : 3 ))
    a_dsi=(--dsi processes:auto:1,2,4 --dsi threads:auto:1,2,4) b_dsi=(--dsi threads:auto:1,2,4)
    [ "$b_servers" -ge 1 ] && b_dsi=(--dsi "processes:auto:$(seq -s, 1 "$b_servers")" "${b_dsi[@]}")
    si=(--si-k 4)
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
    echo "== part 0: tests" | tee -a "$log"
    timeout "$limit_tests" python3 -m pytest -q -p no:cacheprovider tests/unit/models/test_hf.py \
        tests/unit/models/test_hf_static.py tests/unit/models/test_replay.py 2>&1 | tee -a "$log" || status=1
    # the device decisions' CUDA variants only (their CPU ones run in CI)
    timeout 35 python3 -m pytest -q -p no:cacheprovider tests/unit/models/test_device_laws.py -k cuda 2>&1 \
        | tee -a "$log" || status=1
fi

echo "== part f: forwards" | tee -a "$log"
timeout "$limit_f" python3 benchmarks/gpu_forwards.py --config qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct \
    qwen2.5-14b-instruct --device "$device" --dtype "$dtype" "${forwards[@]}" --out "$out/forwards.json" 2>&1 \
    | grep -v "Loading weights" | tee -a "$log" || status=1

part() {  # part NAME LIMIT ARGS...: one real_pair.py run, cut off at LIMIT s (it stops starting
    local name=$1 limit=$2  # new configurations 60 s before that, so its table still prints)
    shift 2
    echo "== part $name" | tee -a "$log"
    timeout "$limit" python3 benchmarks/real_pair.py --replay "$recording" --device "$device" --dtype "$dtype" \
        --target-devices "$device" --deadline $((limit - 60 > 10 ? limit - 60 : 10)) "${common[@]}" "$@" \
        --out "$out/$name.json" 2>&1 | grep -v "Loading weights" | tee -a "$log"
}
part pair_graphs "$limit_a" --cuda-graphs "${si[@]}" "${a_dsi[@]}" || status=1
part target14b_graphs "$limit_b" --cuda-graphs --target-config qwen2.5-14b-instruct "${si[@]}" "${b_dsi[@]}" || status=1
part target14b "$limit_c" --target-config qwen2.5-14b-instruct "${si[@]}" "${b_dsi[@]}" || status=1
python3 benchmarks/gpu_report.py "$out" > "$out/report.md" || status=1
cat "$out/report.md"
echo "gpu_check exit $status" | tee -a "$log"
exit $status
