#!/usr/bin/env bash
# The second prepared run for a lent GPU machine, part d of issue 12: the CPU question that this
# project's 2 cores cannot answer. The machine's 16 CPU cores (no GPU used) run the embedded pair's
# replayed decisions on random-weight CPU models of its architectures (bf16):
#   - each worker alone on 1, 2, 4, 8 and 16 torch threads (the thread scaling of one forward);
#   - non-SI and SI on all 16 cores;
#   - DSI with the cores split between the drafter (d threads, this process) and SP target servers
#     (processes of t threads each), d + SP x t = 16.
# Does any split beat the best SI and non-SI that may use all 16 cores? Fits 9 minutes of wall
# time; writes cpu_cores.{json,log} and machine.txt to $OUT (or results/).
#
# Usage, from the repository root:  bash benchmarks/gpu_check_cpu.sh
# DRY_RUN=1: tiny configurations, a few tokens, on whatever cores this machine has (the tests do).
set -uo pipefail
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out="${OUT:-results}"
mkdir -p "$out"
if [ -n "${DRY_RUN:-}" ]; then
    configs="$(mktemp -d)"
    python3 benchmarks/tiny_configs.py "$configs" || exit 1
    limit=240 cores=2
    extra=(--configs-dir "$configs" --dtype fp32 --tokens 8 --prompts 1 --repeats 1 --latency-threads 1 2
           --si-k 4 --dsi processes:4:1:1:1)
else
    limit=540 cores=16
    extra=(--dtype bf16 --tokens 48 --prompts 2 --repeats 2 --latency-threads 1 2 4 8 16 --si-k 4 6
           --dsi processes:4:2:6:4 --dsi processes:4:3:4:4 --dsi processes:4:2:7:2 --dsi processes:6:1:12:4)
fi
python3 -c "import os, platform, torch; print('python', platform.python_version(), 'torch', torch.__version__, \
'cpus', os.cpu_count(), 'torch threads', torch.get_num_threads())" 2>&1 | tee "$out/machine.txt"
lscpu 2>/dev/null | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)|Flags" | cut -c1-300 | tee -a "$out/machine.txt"
timeout "$limit" python3 benchmarks/real_pair.py --replay benchmarks/recordings/qwen2.5-coder-code-64.json \
    --device cpu --threads "$cores" --deadline $((limit - 90)) "${extra[@]}" --out "$out/cpu_cores.json" 2>&1 \
    | grep -v "Loading weights" | tee "$out/cpu_cores.log"
status=$?
echo "gpu_check_cpu exit $status"
exit $status
