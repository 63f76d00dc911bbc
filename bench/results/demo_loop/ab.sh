#!/bin/bash
# interleaved demo runs: main's venv (before) and d20's (after); arg: rounds, tag
cd /tmp/d20/ab
for k in $(seq 1 $1); do
  for v in main d20; do
    if [ $v = main ]; then bin=/work/main/.venv/bin/pipesched; else bin=/work/wt/d20-demo-loop/.venv/bin/pipesched; fi
    out=/tmp/d20/ab/$2-$v-$k
    l0=$(cut -d' ' -f1 /proc/loadavg); t0=$(date +%s.%N)
    $bin demo --quick -o $out > $out.log 2>&1; rc=$?
    t1=$(date +%s.%N); l1=$(cut -d' ' -f1 /proc/loadavg)
    python3 - "$out" "$v" "$k" "$l0" "$l1" "$t0" "$t1" "$rc" <<'PY'
import json,sys
out,v,k,l0,l1,t0,t1,rc=sys.argv[1:]
tm=json.load(open(out+'/this-machine.json'))
rep=json.load(open(out+'/report.json'))
print(json.dumps({"variant":v,"round":int(k),"load":[float(l0),float(l1)],"wall_s":float(t1)-float(t0),"rc":int(rc),
 "predicted":tm["predicted_step_ms"],"measured":tm["measured_step_ms"],"error":tm["error"],
 "steps":rep["measured_step_times_ms"],"verified":rep["verified"],"max_rel":rep["max_rel_param_error"]}))
PY
  done
done
