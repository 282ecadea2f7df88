#!/bin/bash
# The GPU checks of the open issues, in parts that fit one device call each (10 minutes), run from the repo root on
# the GPU box; logs and JSON land in $OUT (or ./gpu-out). The GPU box's Triton (3.6) cannot build the hopper tier's
# Gluon sources, and it has no network: what it needs is prepared here first and carried (`prepare`, on this box).
#
#   bash tools/gpu_checks.sh prepare                     # here: binaries, the artifact, the carry folders (minutes)
#   bash tools/gpu_checks.sh PART [PART ...]              # there, carrying what each part names below
#
# parts (carry):
#   tests   the gpu-marked tests, hopper-tier binaries bound      (.data/hopper-mla .data/hopper-kda
#                                                                  .data/kda-hopper-rt .peers/stack_carry)
#   kda     bench/kda.py --quick with the hopper decode variants  (.data/hopper-kda .peers/stack_carry)
#   inter   the Gluon KDA state passing: GPU test + bench          (.data/kda-hopper-rt .data/kda-hopper-bench)
#   moe     bench/moe.py decode rows and the 512 / 4096 rows      (.peers/stack_carry)
#   stack   bench/stack.py from the k3-wide h100 artifact          (.art/k3-wide-h100 .peers/stack_carry)
#   serve   constrained decode (k3-wide) and the mixed serve load  (.whl .peers/stack_carry)
#   rooms   the serve-load before/after of issue 55                (.whl .before55 .peers/stack_carry)
#   rooms2  its agentic-load and speculative before/after           (.whl .before55 .peers/stack_carry)
# .peers/stack_carry: bench/stack.py's docstring; .whl: the serving wheels (docs/perf.md, issue 55 section);
# .before55: `git archive d19ba20 | tar -x -C .before55` plus its ab.sh (docs/perf.md, the rooms before/after).
set -o pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1

prepare() {
    python tests/mla/test_mla_hopper_gpu.py build .data/hopper-mla
    python tests/kda/test_kda_decode_hopper_gpu.py build .data/hopper-kda
    python tests/kda/test_kda_hopper_gpu.py build .data/kda-hopper-rt
    python bench/kda_hopper.py build .data/kda-hopper-bench
    rm -rf .art/k3-wide-h100 && k3c compile examples/k3-wide.yaml --target h100 -o .art/k3-wide-h100
    du -sh .data/* .art/k3-wide-h100
}

site() {        # the carried wheels into /tmp/site (the box has pip but no index)
    local wheels=()
    [ -d .peers/stack_carry ] && wheels+=(.peers/stack_carry/*.whl)
    [ -d .whl ] && wheels+=(.whl/*.whl)
    [ ${#wheels[@]} -gt 0 ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        "${wheels[@]}" 2>&1 | grep -v WARNING | tail -3
    export PYTHONPATH=/tmp/site:$PWD
}

run() {         # run NAME SECONDS CMD...: the command's output to $OUT/NAME.log, its tail here
    local name=$1 secs=$2
    shift 2
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name rc=$?"
    tail -25 "$OUT/$name.log" | cut -c1-240
}

part() {
    case $1 in
    tests) K3C_HOPPER_BIN=.data/hopper-mla run gpu-tests 330 python3 -m pytest -q -p no:cacheprovider -m gpu \
               tests/runtime tests/attnres tests/mla tests/codegen/test_kernels.py tests/dist/test_dist_gpu.py
           K3C_HOPPER_KDA_BIN=.data/hopper-kda K3C_HOPPER_BIN=.data/kda-hopper-rt run gpu-tests-kda 200 \
               python3 -m pytest -q -p no:cacheprovider -m gpu tests/kda ;;
    kda)   run kda 300 python3 bench/kda.py --quick --flashkda-so .peers/stack_carry/so/_flashkda_C.abi3.so \
               --hopper-bin .data/hopper-kda --json kda-quick.json ;;
    inter) K3C_HOPPER_BIN=.data/kda-hopper-rt run inter-test 150 python3 -m pytest -q -p no:cacheprovider \
               tests/kda/test_kda_hopper_gpu.py
           run inter-bench 300 python3 bench/kda_hopper.py run .data/kda-hopper-bench --json "$OUT/kda-hopper.json" ;;
    moe)   run moe-decode 200 python3 bench/moe.py --decode --budget 20 --json "$OUT/moe-decode.json"
           run moe-prefill 200 python3 bench/moe.py --sweep --tokens 512 4096 --budget 30 --json "$OUT/moe-prefill.json" ;;
    stack) run stack 420 python3 bench/stack.py --carry .peers/stack_carry --artifact .art/k3-wide-h100 \
               --decode 1x8192,32x8192,128x8192,32x32768,128x32768 --check-len 0 --trained "" --no-profile \
               --out "$OUT/stack-artifact.json" ;;
    serve) run constrained 240 python3 bench/constrained_decode.py --device cuda --models wide --batch 32 \
               --new-tokens 64 --repeats 3 --out "$OUT/constrained-wide.json"
           run mixed 300 python3 bench/serve_load.py --mixed --spec examples/k3-wide.yaml --device cuda \
               --streams 32 --long 16 --compare --split --out "$OUT/serve-mixed.json" ;;
    rooms) run rooms-serve 300 bash .before55/ab.sh serve ;;
    rooms2) run rooms-agentic 250 bash .before55/ab.sh agentic
            run rooms-spec 300 bash .before55/ab.sh spec ;;
    *) echo "unknown part $1 (tests kda inter moe stack serve rooms rooms2; prepare here)" >&2; return 2 ;;
    esac
}

if [ "${1:-}" = prepare ]; then
    prepare
    exit
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
site
for p in "$@"; do
    part "$p" || exit
done
