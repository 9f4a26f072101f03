#!/usr/bin/env bash
# One GPU check for tiermem (issue 21 item 3): everything CUDA-only, in one command, bounded under
# 8 minutes on one GPU. Writes under OUT (default $OUT, else ./gpu_check_out) gpu_check.json (the
# machine: GPU, torch, CUDA, Python; every step: status, seconds, budget, exit status, its JSON output,
# the tail of its log), steps.tsv and one NAME.log per step, and prints a short summary.
#
#   bash bench/gpu_check.sh [--dry-run] [--out DIR] [--python PY] [--wheels DIR]
#
# Paths are taken from where it is started. PY defaults to the repository's .venv/bin/python where
# there is one, else python3: copy the repository without .venv to a GPU machine, or pass --python
# with the Python whose torch has CUDA (a CPU build reports every step as 'no CUDA device').
#
# Steps and their budgets (seconds; a step past its budget is killed and recorded as timed out):
#   install_gds             45  kvikio for this torch's CUDA major (kvikio-cu13 on CUDA 13, else -cu12),
#                               with libkvikio and rapids-logger, into this run's temporary folder (no
#                               other dependency: the CUDA image's own cuda libraries serve it); skipped
#                               when kvikio imports already; without network it fails fast (no
#                               retries) and the kvikio steps say so
#   cuda_tests              80  tests/test_cuda.py (28 of its tests took 43 s on an H200)
#   bench_io_posix_host     20  tiermem bench io, posix, host buffers (256MiB, verified)
#   bench_io_kvikio_host    20  the same through kvikio (skipped where kvikio's probe fails)
#   bench_io_posix_device   20  --buffer device: device memory staged through page-locked bounces
#   bench_io_kvikio_device  20  --buffer device through kvikio: device memory handed to kvikio (cuFile
#                               with GDS, else its compatibility mode)
#   train_keep              40  tiermem train on the GPU, a 152M-parameter GPT, plain states, every
#                               activation kept: the step the others are compared with (27 s on an H200)
#   train_auto              45  the same model planned by tiermem (the default configuration's budget)
#   train_nvme             100  the same, 8 steps, every chunk's states and every activation on NVMe
#                               (79 s for 12 steps on an H200: 4.3 s a step)
#   activations             60  bench/activations.py --device cuda (8 x 1024, seq 512, batch 4): keep,
#                               nvme and auto, one process each, GPU memory peaks and steps side by side
# They sum to 450 s; the probe of the machine before them is held to 20 s, and every step is also cut
# at the script's deadline (470 s after start, the clock started before the wheels are installed), so
# the whole run ends before 8 minutes whatever hangs (a step's kill takes up to 5 s more).
# A step that cannot run here is recorded as skipped, with why; one that fails is recorded with its
# exit status and log tail, and the others still run.
# --dry-run checks the plumbing without a GPU: every step is listed as skipped, the JSON is written.
# tiermem need not be installed: a GPU machine without network cannot `pip install -e .`, so where
# `tiermem.tiers` does not import, the script links tiers/ and schedulers/ into tiermem/ as the
# install maps them, for its own run, and removes the links when it ends.
# --wheels DIR: wheels to install for this run only (into a temporary directory on PYTHONPATH, removed at
# the end), for a GPU machine that reaches no package index. For kvikio on CUDA 13 with Python 3.12, fetched
# where pip reaches PyPI:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d DIR \
#     kvikio-cu13 libkvikio-cu13 'rapids-logger==0.3.*' tomli-w
# tomli-w is tiermem's own dependency that such an image may lack; add any other the image lacks (the
# tests need pytest and pytest-timeout; tiermem numpy, psutil, uvloop, xxhash, tensorstore, rich,
# matplotlib). kvikio's own needs, cuda-pathfinder and cufile, come with torch's CUDA wheels.
# Nothing is installed into the Python itself: wheels and kvikio go to a temporary folder.
set -u
START=$(date +%s)
DEADLINE_S=470
DEADLINE=$(( START + DEADLINE_S ))

DRY_RUN=0
OUT_DIR="${OUT:-./gpu_check_out}"
PY="${PYTHON:-}"
WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --out) OUT_DIR="$2"; shift ;;
    --python) PY="$2"; shift ;;
    --wheels) WHEELS="$2"; shift ;;
    -h|--help) sed -n '2,/^set -u$/{/^set -u$/!p}' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (use --dry-run, --out DIR, --python PY, --wheels DIR)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$WHEELS" ] && ! compgen -G "$WHEELS/*.whl" > /dev/null; then
  echo "gpu_check: --wheels $WHEELS holds no .whl file; give the folder pip download wrote (see --help)" >&2
  exit 2
fi
# paths given relative to where the script was started, before it moves to the repository
OUT_DIR=$(realpath -m "$OUT_DIR")
[ -z "$WHEELS" ] || WHEELS=$(realpath -m "$WHEELS")
case "$PY" in */*) PY=$(realpath -m "$PY") ;; esac
cd "$(dirname "$0")/.."
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=$PWD/.venv/bin/python; else PY=python3; fi
fi
if ! command -v "$PY" > /dev/null; then
  echo "gpu_check: --python $PY is not a program here; give the Python whose torch has CUDA" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
# What this run adds for itself, removed when it ends: links into tiermem/, a folder of installed
# wheels (and kvikio, where install_gds installs it).
LINKS=()
SITE=""
trap 'rm -f "${LINKS[@]}"; [ -z "$SITE" ] || rm -rf "$SITE"' EXIT
if [ "$DRY_RUN" = 0 ]; then
  SITE=$(mktemp -d)
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$DRY_RUN" = 0 ] && [ -n "$WHEELS" ] &&
  ! "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl; then
  echo "gpu_check: installing the wheels in $WHEELS failed (above); going on without them" >&2
fi
if [ "$DRY_RUN" = 0 ] && ! "$PY" -c "import tiermem.tiers, tiermem.schedulers" 2>/dev/null; then
  for part in tiers schedulers; do
    if [ ! -e "tiermem/$part" ]; then ln -s "../$part" "tiermem/$part" && LINKS+=("tiermem/$part"); fi
  done
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
STEPS="$OUT_DIR/steps.tsv"
: > "$STEPS"

# The machine, and whether CUDA is there: one Python start (a cold torch import takes seconds).
CUDA=0
MACHINE='{}'
NO_CUDA="no CUDA device: torch.cuda.is_available() is false"
if [ "$DRY_RUN" = 0 ]; then
  MACHINE=$(timeout -k 2 20 "$PY" -c "
import json, platform, torch
facts = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,
         'cuda_available': torch.cuda.is_available()}
if facts['cuda_available']:
    facts['gpu'] = torch.cuda.get_device_name()
try:
    import kvikio
    facts['kvikio'] = kvikio.__version__
except Exception as exc:
    facts['kvikio'] = 'not importable: ' + str(exc)
print(json.dumps(facts))" 2>/dev/null | tail -1)
  if [ -z "$MACHINE" ]; then
    MACHINE='{"probe": "failed or took over 20 s"}'
    NO_CUDA="$PY could not import torch within 20 s (give --python the Python whose torch has CUDA)"
  fi
  case "$MACHINE" in *'"cuda_available": true'*) CUDA=1 ;; esac
fi

# step NAME BUDGET_S NEEDS(cuda|any) CMD...: run CMD for at most its budget (and never past the
# deadline), its output in NAME.log. A log line "SKIP-STEP: why" marks the step skipped.
step() {
  local name="$1" budget="$2" needs="$3"; shift 3
  local log="$OUT_DIR/$name.log" command="$*"
  command="${command//[$'\t\n']/ }"  # one TSV line per step
  if [ "$DRY_RUN" = 1 ]; then
    printf '%s\tskipped\t0\t%s\t-\tdry run: would run: %s\n' "$name" "$budget" "$command" >> "$STEPS"; return
  fi
  if [ "$needs" = cuda ] && [ "$CUDA" = 0 ]; then
    printf '%s\tskipped\t0\t%s\t-\t%s\n' "$name" "$budget" "$NO_CUDA" >> "$STEPS"; return
  fi
  local t0 rc status limit
  t0=$(date +%s)
  limit=$(( DEADLINE - t0 < budget ? DEADLINE - t0 : budget ))
  if [ "$limit" -lt 5 ]; then
    printf '%s\tskipped\t0\t%s\t-\tno time left: the script stops at %s s\n' "$name" "$budget" "$DEADLINE_S" >> "$STEPS"; return
  fi
  timeout -k 5 "$limit" "$@" > "$log" 2>&1
  rc=$?
  status=passed
  [ "$rc" != 0 ] && status=failed
  { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && status="timed out after ${limit}s"
  grep -q "^SKIP-STEP:" "$log" && status=skipped
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" "$budget" "$rc" \
    "$(grep -m1 '^SKIP-STEP:' "$log" | cut -c11-)" >> "$STEPS"
}

# kvikio steps run only where kvikio's own probe (a real write and read here) succeeds.
KVIKIO_OR_SKIP="from tiermem.tiers.backends import kvikio_backend as k; import sys, tempfile; \
ok, why = k.probe(tempfile.gettempdir()); ok or print('SKIP-STEP: kvikio unusable: ' + why); sys.exit(0 if ok else 3)"
BENCH="'$PY' -m tiermem bench io --size 256MiB --repeats 2 --verify --json"

# kvikio's wheels are built per CUDA major version: the ones that match this torch's.
CU=cu12
case "$MACHINE" in *'"cuda": "13'*) CU=cu13 ;; esac
step install_gds 45 any bash -c "'$PY' -c 'import kvikio' 2>/dev/null && { echo 'SKIP-STEP: kvikio imports already'; exit 0; }; \
  PIP_DISABLE_PIP_VERSION_CHECK=1 '$PY' -m pip install --quiet --retries 0 --timeout 10 --no-deps --target '${SITE:-SITE}' \
  kvikio-$CU libkvikio-$CU 'rapids-logger==0.3.*'"
step cuda_tests 80 cuda "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py
step bench_io_posix_host 20 cuda bash -c "$BENCH --backend posix"
step bench_io_kvikio_host 20 cuda bash -c "'$PY' -c \"$KVIKIO_OR_SKIP\" && $BENCH --backend kvikio"
step bench_io_posix_device 20 cuda bash -c "$BENCH --backend posix --buffer device"
step bench_io_kvikio_device 20 cuda bash -c "'$PY' -c \"$KVIKIO_OR_SKIP\" && $BENCH --backend kvikio --buffer device"
TRAIN="'$PY' -m tiermem train --json --layers 12 --d-model 1024 --heads 16 --seq-len 512 --batch-size 8"
step train_keep 40 cuda bash -c "$TRAIN --steps 12 --no-states --policy keep"
step train_auto 45 cuda bash -c "$TRAIN --steps 12"
step train_nvme 100 cuda bash -c "$TRAIN --steps 8 --state-home nvme --policy nvme"
step activations 60 cuda "$PY" bench/activations.py --device cuda --layers 8 --d-model 1024 --seq 512 --batch 4 \
  --steps 3 --rounds 1 --policies keep,nvme,auto --json

"$PY" - "$OUT_DIR" "$STEPS" "$DRY_RUN" "$CUDA" "$(( $(date +%s) - START ))" "$DEADLINE_S" "$MACHINE" <<'EOF'
import json, os, re, sys

out_dir, steps_file, dry_run, cuda, seconds = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1", int(sys.argv[5])
steps = []
for line in open(steps_file):
    name, status, secs, budget, rc, note = (line.rstrip("\n").split("\t") + [""] * 6)[:6]
    entry = {
        "step": name, "status": status, "seconds": int(secs), "budget_s": int(budget),
        "exit_status": None if rc == "-" else int(rc),
    }
    if note:
        entry["note"] = note
    log = os.path.join(out_dir, name + ".log")
    if os.path.exists(log):
        text = open(log, errors="replace").read()
        entry["log_tail"] = text[-2000:]
        # the step's --json output, when it printed one: the first JSON object that opens a line
        # (a log line such as "machine: {...}" is not it)
        for match in re.finditer(r"(?m)^\{", text):
            try:
                entry["result"] = json.JSONDecoder().raw_decode(text[match.start():])[0]
                break
            except ValueError:
                continue
    steps.append(entry)
counts = {s: sum(e["status"] == s for e in steps) for s in ("passed", "failed", "skipped")}
summary = (
    f"gpu_check: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped, "
    f"{len(steps) - sum(counts.values())} timed out, in {seconds}s"
    + (" (dry run: nothing ran)" if dry_run else "" if cuda else " (no CUDA device here)")
)
report = {
    "summary": summary, "dry_run": dry_run, "cuda": cuda, "seconds": seconds,
    "budget_s": sum(e["budget_s"] for e in steps), "deadline_s": int(sys.argv[6]),
    "machine": json.loads(sys.argv[7]), "steps": steps,
}
with open(os.path.join(out_dir, "gpu_check.json"), "w") as fh:
    json.dump(report, fh, indent=2)
print(summary)
for e in steps:
    print(f"  {e['step']:<22} {e['status']:<10} {e['seconds']:>4}s of {e['budget_s']:>3}s  {e.get('note', '')}")
print(f"written: {os.path.join(out_dir, 'gpu_check.json')}")
EOF
