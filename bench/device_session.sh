#!/bin/bash
# shellcheck disable=SC2086,SC1007  # numeric ${VAR:-default}s; CUDA_VISIBLE_DEVICES= hides the GPU on purpose
# The device checks in one call, for a session lent a GPU machine (one NVIDIA GPU, its own torch, no network).
#
# What the machine lacks is carried as wheels (Python 3.12, x86-64), downloaded here once into .whl/ (ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 -d .whl \
#     pydantic pydantic_core pydantic-settings python-dotenv annotated-types typing-inspection ortools \
#     immutabledict protobuf PuLP highspy fastapi starlette uvicorn SQLAlchemy tomli_w opentelemetry-api
#   (the versions of this checkout's venv: `pip list`; about 56 MB; with the checkout that is over the 64 MiB a call
#   carries, so repack PuLP's wheel with its linux/i64 CBC alone (its RECORD rewritten): 43 MB)
# then run it from the repository's root there, carrying .whl:  bash bench/device_session.sh
# Parts (skip one with SKIP_STEPS=1, SKIP_MOE=1, SKIP_AB=1, SKIP_LOOP=1, SKIP_BARS=1): the Llama-shaped FSDP2 steps (device_step_bench), one
# EP rank's MoE layer (moe_layer_device), the launcher's start methods on the machine's CPU cores (runtime_bench),
# the closed loop on NCCL with one rank (profile -> solve -> run), issue 25's bars on gloo as a checker reads them
# (bench/issue25_bars.py, one launch after another until BARS_UNTIL s) on the machine's quiet cores: beside the same
# bars on the project's shared 2-core VM, what the machine's contention makes of them. Results in $OUT.
# Lessons of the first H200 session: run Python from outside the checkout (its pipesched/ folder shadows the
# installed package), install the package itself with --upgrade (its console script), and check every import first.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
[ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 4
REPO=$(pwd); export PYTHONPATH=/tmp/site:$REPO; cd /tmp || exit 6
export PATH=/tmp/site/bin:$PATH
{ nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total --format=csv; nproc; uptime;
  python3 -c "import torch,pipesched.runtime.launch as l;print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.nccl.version(), l.__file__)"; } > "$OUT"/env.txt 2>&1
python3 -c "import pipesched.api.cli, pipesched.api.app, pipesched.optimizer.solvers.milp, pipesched.optimizer.solvers.portfolio, pipesched.runtime.training; print('imports ok')" >> "$OUT"/env.txt 2>&1 || { cat "$OUT"/env.txt; exit 5; }
el "env done"; cat "$OUT"/env.txt
# 1. Llama-shaped FSDP2 steps (rows in the calibration's format), with the profiler's kernel breakdown
[ -n "$SKIP_STEPS" ] || { timeout ${STEP_S:-230} python3 -m bench.device_step_bench --measure "$OUT"/rows.json --breakdown --budget-s ${STEP_BUDGET:-170} > "$OUT"/steps.log 2>&1; el "step bench rc=$?"; tail -12 "$OUT"/steps.log; }
# 2. one expert-parallel rank's MoE layer (issue 28)
[ -n "$SKIP_MOE" ] || { timeout ${MOE_S:-90} python3 -m bench.moe_layer_device --measure "$OUT"/moe_layer.json --device cuda --budget-s ${MOE_BUDGET:-60} > "$OUT"/moe.log 2>&1; el "moe rc=$?"; tail -5 "$OUT"/moe.log; }
# 3. start methods: the runtime bench's one-stage shape (1F1B, ZB-H1, 2BW on 2 gloo ranks), alternating
mkdir -p /tmp/ab
ab() {
  for m in spawn forkserver; do
    s=$(date +%s)
    CUDA_VISIBLE_DEVICES= PIPESCHED_START_METHOD=$m timeout ${AB_S:-100} python3 -W ignore::RuntimeWarning -m bench.runtime_bench --shapes 0 --rounds 1 --steps 4 --no-other-slowdown > /tmp/ab/rb_${m}_$1.txt 2>&1
    { echo "== $m $1 rc=$? wall=$(( $(date +%s) - s ))s load=$(cut -d' ' -f1 /proc/loadavg)"; grep -E "^ +(1F1B|ZB-H1|2BW) (yes|no)|calibration run|gain over 1F1B, best" /tmp/ab/rb_${m}_$1.txt; } >> "$OUT"/ab.txt
  done
  el "ab $1 done"
}
[ -n "$SKIP_AB" ] || ab 1
# 4. the closed loop on NCCL, one rank
if [ -z "$SKIP_LOOP" ]; then
mkdir -p /tmp/loop && (
  timeout ${PROFILE_S:-150} pipesched profile --device cuda --num-ranks 1 --num-microbatches 8 --model ${LOOP_MODEL:-gpt-350m} -o /tmp/loop/problem.json &&
  pipesched solve /tmp/loop/problem.json --method 1f1b -o /tmp/loop/schedule.json &&
  timeout ${RUN_S:-150} pipesched run /tmp/loop/schedule.json --backend nccl --model ${LOOP_MODEL:-gpt-350m} --steps 4 -o /tmp/loop/report.json ) > "$OUT"/loop.log 2>&1
el "loop rc=$?"; grep -v "^[EWI]1127" "$OUT"/loop.log | tail -8
tar czf "$OUT"/loop.tar.gz -C /tmp loop 2>/dev/null
fi
# 4b. issue 25's bars on gloo, the GPU hidden, one launch after another while time is left
if [ -z "$SKIP_BARS" ]; then
  for i in 1 2 3 4 5 6; do
    [ $(( $(date +%s) - T0 )) -gt ${BARS_UNTIL:-330} ] && break
    CUDA_VISIBLE_DEVICES= timeout ${BAR_S:-200} python3 -W ignore::RuntimeWarning "$REPO"/bench/issue25_bars.py --launches 1 \
      --bars ${BARS:-1,2,3} --tag "quiet_cores_$i" --output "$OUT"/bars.jsonl > "$OUT"/bars_$i.log 2>&1
    el "bars launch $i rc=$?"
  done
  python3 "$REPO"/bench/issue25_bars.py --summary "$OUT"/bars.jsonl
fi
# 5. more A/B pairs while time is left
for i in 2 3 4; do [ $(( $(date +%s) - T0 )) -gt ${AB_UNTIL:-250} ] && break; [ -n "$SKIP_AB" ] || ab $i; done
cat "$OUT"/ab.txt
tar czf "$OUT"/ab.tar.gz -C /tmp ab 2>/dev/null
el "end"
