#!/usr/bin/env bash
# One GPU check for tiermem (issue 21 item 3): everything CUDA-only, in one command, under 8 minutes
# on one GPU. Writes gpu_check.json (every step: status, seconds, exit status, its JSON output, the
# tail of its log) and a short summary under OUT (default $OUT, else ./gpu_check_out).
#
#   bash bench/gpu_check.sh [--dry-run] [--out DIR] [--python PY]
#
# Steps: install the gds extra (kvikio; without network or GDS it says so and goes on), the CUDA
# tests (tests/test_cuda.py), `tiermem bench io` with posix and kvikio on host buffers, NVMe
# writes/reads of device buffers through posix (pinned bounces) and kvikio (device memory),
# activation offload keep vs nvme on a GPU GPT (bench/activations.py), model states at 10% device
# vs plain (bench/states.py). A step that cannot run here is recorded as skipped, with why; one
# that fails is recorded with its exit status and log tail, and the others still run.
# --dry-run checks the plumbing without a GPU: every step is listed as skipped, the JSON is written.
set -u
cd "$(dirname "$0")/.."

DRY_RUN=0
OUT_DIR="${OUT:-./gpu_check_out}"
PY="${PYTHON:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --out) OUT_DIR="$2"; shift ;;
    --python) PY="$2"; shift ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (use --dry-run, --out DIR, --python PY)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p "$OUT_DIR"
STEPS="$OUT_DIR/steps.tsv"
: > "$STEPS"
START=$(date +%s)

CUDA=0
if [ "$DRY_RUN" = 0 ] && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  CUDA=1
fi

# step NAME TIMEOUT_S NEEDS(cuda|any) CMD...: run CMD with a timeout, its output in NAME.log.
step() {
  local name="$1" limit="$2" needs="$3"; shift 3
  local log="$OUT_DIR/$name.log"
  if [ "$DRY_RUN" = 1 ]; then
    printf '%s\tskipped\t0\t-\tdry run: would run: %s\n' "$name" "$*" >> "$STEPS"; return
  fi
  if [ "$needs" = cuda ] && [ "$CUDA" = 0 ]; then
    printf '%s\tskipped\t0\t-\tno CUDA device: torch.cuda.is_available() is false\n' "$name" >> "$STEPS"; return
  fi
  local t0 rc status
  t0=$(date +%s)
  timeout "$limit" "$@" > "$log" 2>&1
  rc=$?
  status=passed
  [ "$rc" != 0 ] && status=failed
  [ "$rc" = 124 ] && status="timed out after ${limit}s"
  grep -q "^SKIP-STEP:" "$log" && status=skipped
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" "$rc" "$(grep -m1 '^SKIP-STEP:' "$log" | cut -c11-)" >> "$STEPS"
}

step install_gds 120 any "$PY" -m pip install --quiet -e ".[gds]"
step cuda_tests 200 cuda "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py
step bench_io_posix 45 cuda "$PY" -m tiermem bench io --backend posix --size 512MiB --repeats 2 --json
step bench_io_kvikio 45 cuda bash -c "'$PY' -c 'import kvikio' 2>/dev/null || { echo 'SKIP-STEP: kvikio not importable (the gds extra did not install; see install_gds.log)'; exit 0; }; '$PY' -m tiermem bench io --backend kvikio --size 512MiB --repeats 2 --json"
step device_buffers 60 cuda "$PY" bench/gpu_device_io.py --size 512MiB
step activations 90 cuda "$PY" bench/activations.py --layers 8 --d-model 1024 --seq 1024 --batch 8 --steps 3 --rounds 1 --policies keep,nvme --json
step states 120 cuda "$PY" bench/states.py --size 200M --steps 3 --rounds 1 --device-fraction 0.10 --json

"$PY" - "$OUT_DIR" "$STEPS" "$DRY_RUN" "$CUDA" "$(( $(date +%s) - START ))" <<'EOF'
import json, os, sys

out_dir, steps_file, dry_run, cuda, seconds = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1", int(sys.argv[5])
steps = []
for line in open(steps_file):
    name, status, secs, rc, note = (line.rstrip("\n").split("\t") + [""] * 5)[:5]
    entry = {"step": name, "status": status, "seconds": int(secs), "exit_status": None if rc == "-" else int(rc)}
    if note:
        entry["note"] = note
    log = os.path.join(out_dir, name + ".log")
    if os.path.exists(log):
        text = open(log, errors="replace").read()
        entry["log_tail"] = text[-2000:]
        start = text.find("{")
        if start >= 0:  # the step's --json output, when it printed one
            try:
                entry["result"] = json.loads(text[start:])
            except ValueError:
                pass
    steps.append(entry)
counts = {s: sum(e["status"] == s for e in steps) for s in ("passed", "failed", "skipped")}
summary = (
    f"gpu_check: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped, "
    f"{len(steps) - sum(counts.values())} timed out, in {seconds}s"
    + (" (dry run: nothing ran)" if dry_run else "" if cuda else " (no CUDA device here)")
)
report = {"summary": summary, "dry_run": dry_run, "cuda": cuda, "seconds": seconds, "steps": steps}
with open(os.path.join(out_dir, "gpu_check.json"), "w") as fh:
    json.dump(report, fh, indent=2)
print(summary)
for e in steps:
    print(f"  {e['step']:<16} {e['status']:<10} {e['seconds']:>4}s  {e.get('note', '')}")
print(f"written: {os.path.join(out_dir, 'gpu_check.json')}")
EOF
