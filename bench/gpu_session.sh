#!/usr/bin/env bash
# A GPU session's runs for issues 11 and 12, one stage per device call (each under its 10-minute
# limit). A task drawn for a GPU now has 15 minutes of device time in all, the machine's start (a
# minute or two) and its idle waits included, and no machine starts with under 4 minutes left: plan
# on one call, `first` (at most 9.5 minutes), with timeout_s 600, then give the machine back. The
# machine has torch, triton and transformers but no pyzmq and no package index: run
# bench/gpu_wheels.sh here first, and carry .whl/ in every call (../shared/GPU.md). Logs and each
# benchmark's JSON land in $OUT; the last lines printed are a summary.
#
#   bash bench/gpu_session.sh first    # pytest -m gpu, then the engine at batch 1 and 64 x 512 (one call, < 9.5 min)
#   bash bench/gpu_session.sh check    # kernels compile, pytest -m gpu            (~5 min)
#   bash bench/gpu_session.sh engine   # bench engine on dummy:llama-1b, both modes, vs transformers
#   bash bench/gpu_session.sh cluster  # bench transfer, handoff and chaos on cuda:0
#   bash bench/gpu_session.sh serve    # bench serve: mono vs 1p1d vs 2p2d on dummy:llama-1b, step traces
#   bash bench/gpu_session.sh prefix   # bench serve shared_prefixes: least_loaded vs prefix_affine, 2p1d (~2 min)
#   bash bench/gpu_session.sh overlap  # 1p1d served with and without --async-scheduling: loop share, ITL
#   bash bench/gpu_session.sh profile  # bench step-profile: a step's host and device time, the kernels by time, a prefill's (~1 min)
#   bash bench/gpu_session.sh tiles    # the invariant matmul's tiles: which give the same bits, how fast each (~2 min)
#   bash bench/gpu_session.sh prefill-rows  # a prefill in each attention tile auto may choose, invariance in 64x2 (~8 min)
#   bash bench/gpu_session.sh verify   # tests, profile, transfers, handoff, engine vs transformers, grid (BUDGET s)
#   bash bench/gpu_session.sh scaling  # bench scaling on one GPU: 1mono, 2mono, 1p1d under chat (~8 min)
#   bash bench/gpu_session.sh router   # bench router on the GPU host's CPU: SDK, HTTP, 4 API servers  (~2 min, no GPU)
#   bash bench/gpu_session.sh speculative  # bench speculative on dummy:llama-1b: drafts' eager chunks vs the graphs (~3 min)
#   bash bench/gpu_session.sh placement    # bench serve: 1p1d vs +local256 vs +queue2 vs mono (local prefill, ~6 min)
set -u
# A machine goes back 30 s after a call and a new one takes a minute or more to start. On 2026-11-27
# one session had 900 s of device time: `BUDGET=540 ... verify` (545 s) and, on the warm machine, the
# batch-256 point and `bench handoff` (152 s); results in bench/results/h100-llama1b-2026-11-27/.
# On 2026-11-28 an H200 ran `BUDGET=540 ... verify` (549 s) and the engine beside transformers (151 s);
# results in bench/results/h200-llama1b-2026-11-28/. The attention ran 4-7x slower than on 2026-11-27:
# Triton 3.6 gathered K/V 2 bytes a load (238a83c's reshaped offsets), fixed in e9ae001, which gpu.txt
# now checks on the machine (split_kernel_loads: no load under 8 bytes). Next: `BUDGET=540 ... verify`
# again, timeout_s 600. It answers:
# - whether the attention is back to 2026-11-27's (attention-tiles: b64 KV 512 45.9 us a layer, a
#   2,048-token chunk's 32-row tiles about 224 us) or better, with the loops over a tile's own splits
#   and steps and split_lanes, which have only run with the slow gathers so far;
# - whether test_async_scheduling_on_the_gpu_gives_the_synchronous_tokens[bfloat16] still fails (1 run
#   in 6 on the H200: the same tokens, logprobs 0.002-0.014 apart); auto's start-up choices no longer
#   follow timing noise (92d506a). If it fails again, the choice is not the cause: look for a
#   schedule that depends on timing in async mode;
# - where a 2,048-token prefill's idle device time goes, and async at batch 256 (step-profile: it ran
#   out of time at 256 on the H200, with the slow attention);
# - cuda_ipc: 0.35 ms of host work before the header at 8 MiB (target 0.1 ms over the copy), and
#   streaming's 5.3 ms of host time in a 1,000-token prefill (handoff).
# Untested on a GPU since the H200 run: the K/V gathers (e9ae001), auto's stable choices and their
# bit check after a cached prefix (92d506a), and the split kernel's ONE_SPLIT variant (a launch whose
# lanes cover every split: 127 registers for the 32-row prefill tile under Triton 3.6, looping 191);
# since 2026-11-29 the matmul partials' 16-byte accesses (gpu.txt: partials_accesses), a streamed
# step's block ids kept for every request it streams, and a cuda_ipc transfer refused when its
# writer has died; later that day, top logprobs by one topk over int64 keys (the logprob's bits,
# then the lower id) where it was topk over the float logprobs (the async logprobs test runs it);
# since 2026-11-29 (twentieth session), every shm/cuda_ipc copy is counted for its decode worker
# (common/kv_transport/copy_count.py: a per-thread slot's lock held through the copy, a cuda_ipc
# copy to another GPU included, which synchronizes inside it): the cuda_ipc gpu tests run it.
# since 2026-11-29 (twenty-third session), the paged attention's output is allocated in rows of
# head_dim whatever its query's layout, the invariant linear copies a weight that is not row-major,
# and test_triton_decode_on_the_gpu_equals_sdpa_and_is_batch_invariant compares the split kernel's
# looping variant (tables past LANES splits, and LANES=1) with the one-pass one, bit for bit.
# since 2026-11-29 (twenty-sixth session), top logprobs build their int64 keys in place (the async
# logprobs test runs it), the cached block-id uploads of a cuda_ipc copy take a lock, and
# EngineConfig resolves a CUDA device (and torch's dtype) after its other checks, importing torch there.
# since 2026-11-30 (twenty-seventh session), a prefill worker's KV messages to a decode worker go by
# try_send(track=True), at most PEER_SEND_WAIT_S (1 s) at a full queue (nccl's announce included), and
# KVReserve by send_nowait: bench handoff and the cluster GPU tests run it.
# since 2026-11-30 (twenty-ninth session), a request whose structured output waits for its
# structured_outputs_after run (reasoning, then JSON) has its first mask applied on the device where
# its pending token ends the run (logits_processing.adjust, no host sync):
# test_a_structured_output_after_its_run_on_the_gpu_... runs it, through graphs and async.
# A helper counted 60-70 us of Python a streamed piece on the cuda_ipc path, not
# the ~330 us measured: transfer-layers' --profile should name the call that blocks (an event's
# record, wait_event, set_device, the Triton launcher's pointer checks, or garbage collection).
# Cluster stages serve 4,096-token contexts: sized for llama-1b's whole 131,072, each worker would set
# GBs aside for one step's attention partials (a GPU test starts a cluster with no flag at all).
CTX=--worker-arg=--max-model-len=4096
# pytest in one process, whether pytest-xdist is here or not (pyproject's addopts ask for it: -n auto)
ONE_PROCESS="-p no:xdist -o addopts="
stage=${1:?usage: bench/gpu_session.sh first|check|engine|cluster|serve|prefix|overlap|profile|tiles|prefill-rows|verify|scaling|router|speculative}
OUT=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/optional/*.whl 2>/dev/null ||
    echo "llguidance did not install: structured outputs are off here, and the tests leave them out" >&2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import zmq, msgpack, prometheus_client" || {
    echo "a module pdserve needs is missing: run bench/gpu_wheels.sh on the CPU machine and carry .whl" >&2
    exit 1
}
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m common.cli "$@"\n' > /tmp/bin/pdserve && chmod +x /tmp/bin/pdserve
export PATH=/tmp/bin:$PATH

run() {  # run NAME SECONDS CMD...: its output in $OUT/NAME.log, its last line (a bench's JSON) in NAME.json
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    # SIGINT first: pytest then prints its failures and summary, a bench what it has
    timeout -s INT -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    # a bench's last line is its JSON
    tail -n 1 "$OUT/$name.log" | grep '^{' > "$OUT/$name.json" || rm -f "$OUT/$name.json"
    echo "$name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}

case $stage in
first)
    # (the CPU suite compiles every Triton kernel for sm_90 already: tests/triton_aot.py)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
    run gpu-tests 360 python3 -m pytest $ONE_PROCESS -m gpu tests -v --tb=short -p no:cacheprovider --timeout 200 -rf \
        --durations=15 --junitxml="$OUT/gpu-tests.xml" --continue-on-collection-errors
    run engine 170 pdserve bench engine --device cuda:0 --model dummy:llama-1b --max-model-len 4096 \
        --batch-sizes 1,64 --kv-lens 512 --steps 32 --num-requests 16 --output-len 32
    tail -n 15 "$OUT/gpu-tests.log"
    grep -v '^{' "$OUT/engine.log" | tail -n 40
    ;;
check)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
    python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt"
    run aot 120 python3 -m tests.triton_aot
    run gpu-tests 420 python3 -m pytest $ONE_PROCESS -m gpu tests -v --tb=short -p no:cacheprovider --timeout 300 -rf \
        --durations=15 --junitxml="$OUT/gpu-tests.xml" --continue-on-collection-errors
    tail -n 15 "$OUT/gpu-tests.log"
    ;;
engine)
    # two runs, so that a timeout loses one JSON line, not both: the whole grid in both modes, then
    # transformers' generate beside ours on two points
    run engine 380 pdserve bench engine --device cuda:0 --model dummy:llama-1b --max-model-len 4096 \
        --batch-sizes 1,16,64,256 --kv-lens 64,512,2048 --steps 32
    run engine-vs-hf 180 pdserve bench engine --device cuda:0 --model dummy:llama-1b --max-model-len 4096 \
        --vs-transformers --batch-sizes 1,64 --kv-lens 512 --steps 32
    grep -v '^{' "$OUT/engine.log" "$OUT/engine-vs-hf.log" | tail -n 70
    ;;
cluster)
    run transfer-256m 90 pdserve bench transfer --transport cuda_ipc --devices cuda:0 --tokens 8192 --model dummy:llama-1b
    run transfer-8m 90 pdserve bench transfer --transport cuda_ipc --devices cuda:0 --tokens 256 --model dummy:llama-1b
    run handoff 150 pdserve bench handoff --model dummy:llama-1b --tokens 1000 --devices cuda:0 "$CTX"
    # bfloat16 (the GPU default): a migrated request's re-prefill is token-exact by the batch-invariant kernels
    run chaos 240 pdserve bench chaos --model dummy:llama-1b --devices cuda:0 --requests 200 --kills 6 "$CTX"
    tail -n 40 "$OUT/transfer-256m.log" "$OUT/handoff.log" "$OUT/chaos.log" | grep -v '^{'
    ;;
serve)
    # each worker's steps: the decode worker's loop share at batch >= 48 (issue 11: overlap if Python is over 20%)
    export PDSERVE_STEP_TRACE=$OUT/steps
    run serve 540 pdserve bench serve --model dummy:llama-1b --devices cuda:0 --topologies mono,1p1d,2p2d \
        --scenarios realistic,long_prompts "$CTX"
    grep -v '^{' "$OUT/serve.log" | tail -n 40
    python3 -m common.step_trace "$OUT/steps" 48 | tee "$OUT/loop-share.jsonl"
    ;;
placement)
    # local prefill on a GPU: what short prompts and bursts gain without a handoff, and what the
    # decodes beside a local prefill lose (ITL), against 1p1d and mono
    run placement 420 pdserve bench serve --model dummy:llama-1b --devices cuda:0 \
        --topologies 1p1d,1p1d+local256,1p1d+queue2,mono --scenarios concurrent_64,stress_test,realistic "$CTX"
    grep -v '^{' "$OUT/placement.log" | tail -n 16
    ;;
prefix)
    # routing by prefix on a GPU: 16 documents of 768 tokens over 1.5 prefill pools, least_loaded vs prefix_affine
    run prefix 300 pdserve bench serve --model dummy:llama-1b --devices cuda:0 --topologies 2p1d \
        --scenarios shared_prefixes --policies least_loaded,prefix_affine "$CTX"
    grep -v '^{' "$OUT/prefix.log" | tail -n 8
    ;;
overlap)
    # issue 11: does async scheduling hide the decode worker's host work? 64 streams in flight, each way.
    for mode in sync async; do
        flags=(--worker-arg=--no-async-scheduling)  # async is the default on CUDA
        [ "$mode" = async ] && flags=(--worker-arg=--async-scheduling)
        export PDSERVE_STEP_TRACE=/tmp/steps-$mode  # (not in $OUT: only 8 files come back)
        run "serve-$mode" 270 pdserve bench serve --model dummy:llama-1b --devices cuda:0 --topologies 1p1d \
            --scenarios concurrent_64 "$CTX" "${flags[@]}"
        grep -v '^{' "$OUT/serve-$mode.log" | tail -n 12
        python3 -m common.step_trace "/tmp/steps-$mode" 48 | tee "$OUT/loop-share-$mode.jsonl"
    done
    ;;
profile)
    # issue 11: where the decode step's time goes, both kernel modes, batch 1 and 64
    run step-profile 240 pdserve bench step-profile --device cuda:0 --model dummy:llama-1b --max-model-len 4096 \
        --batch-sizes 1,64 --kv-len 512 --steps 32 --top 20 --prefill-len 2048
    grep -v '^{' "$OUT/step-profile.log" | grep -B2 -A4 "where a step's time goes"
    ;;
verify)
    # after kernel changes, in one call of at most $BUDGET seconds (400): the GPU tests, the step
    # profile (batch 1, 64 and 256, sync and async, and a 2,048-token prefill), cuda_ipc transfers of
    # 8 and 256 MiB, the handoff with and without streaming, the attention's variants (and whether
    # 128-row prefill tiles keep the bits), as much of the whole engine grid as the time left allows
    # (each point is printed as it is taken), then the engine beside transformers if time is left
    end=$((SECONDS + ${BUDGET:-400}))
    left() { local l=$((end - SECONDS)); echo $((l < $1 ? (l > 5 ? l : 5) : $1)); }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
    # the machine's Triton, and how it compiles the attention's K/V gathers (16 bytes a load, not 2)
    # and the matmul partials' writes and reads (16 bytes an access, not 4)
    python3 -c "import torch, triton; print(torch.__version__, triton.__version__)
from tests.triton_aot import split_kernel_loads, partials_accesses; print(split_kernel_loads())
print(partials_accesses())" >> "$OUT/gpu.txt" 2>&1
    run gpu-tests "$(left 260)" python3 -m pytest $ONE_PROCESS -m gpu tests -q --tb=short -p no:cacheprovider --timeout 200 -rf \
        --durations=5 --continue-on-collection-errors
    run step-profile "$(left 100)" pdserve bench step-profile --device cuda:0 --model dummy:llama-1b \
        --max-model-len 4096 --batch-sizes 1,64,256 --kv-len 512 --steps 16 --top 12 --prefill-len 2048
    # issue 12 on one GPU: the one-launch block copy and the IPC event (at most 0.1 ms over the copy; vs_d2d >= 0.5)
    run transfer-8m "$(left 40)" pdserve bench transfer --transport cuda_ipc --devices cuda:0 --tokens 256 \
        --model dummy:llama-1b --profile 12
    # a streamed 1,000-token prefill's sends (16 layer groups): where its 5.3 ms of host time went on the H200
    run transfer-layers "$(left 40)" pdserve bench transfer --transport cuda_ipc --devices cuda:0 --tokens 1008 \
        --model dummy:llama-1b --layer-groups 16 --profile 15
    run transfer-256m "$(left 40)" pdserve bench transfer --transport cuda_ipc --devices cuda:0 --tokens 8192 \
        --model dummy:llama-1b
    run handoff "$(left 110)" pdserve bench handoff --model dummy:llama-1b --tokens 1000 --devices cuda:0 "$CTX"
    run attention-tiles "$(left 55)" python3 -m bench.attention_tiles
    run engine-grid "$(left 400)" pdserve bench engine --device cuda:0 --model dummy:llama-1b --max-model-len 4096 \
        --batch-sizes 1,16,64,256 --kv-lens 64,512,2048 --steps 16 --num-requests 16 --output-len 32
    # (transformers' half compiles its static-cache step per shape: 134 s was not enough on 2026-11-26, 172 s was)
    run engine-vs-hf "$(left 200)" pdserve bench engine --device cuda:0 --model dummy:llama-1b --max-model-len 4096 \
        --vs-transformers --batch-sizes 1,64 --kv-lens 512 --steps 32
    tail -n 4 "$OUT/gpu-tests.log"
    grep -v '^{' "$OUT/engine-vs-hf.log" | tail -n 40
    grep -A5 "where a step" "$OUT/step-profile.log"
    grep -A14 "^prefill of one" "$OUT/step-profile.log"
    grep -A8 "with async scheduling" "$OUT/step-profile.log" | tail -n 9
    grep "waits for the device" "$OUT/step-profile.log"
    grep -A16 "the Triton kernels these steps compiled" "$OUT/step-profile.log"
    grep -ho "attention triton ([^)]*)" "$OUT/engine-grid.log" "$OUT/engine-vs-hf.log" | head -n 1
    grep -v '^{' "$OUT/attention-tiles.log" | tail -n 9
    grep -v '^{' "$OUT/transfer-8m.log" "$OUT/transfer-256m.log" "$OUT/handoff.log" | tail -n 20
    grep -v '^{' "$OUT/transfer-layers.log" | tail -n 28
    grep '^\[' "$OUT/engine-grid.log" | grep -v "profiling\|prefill of"
    ;;
scaling)
    # how many prefill and decode workers, on one H100: one replica, two sharing it, and 1P1D sharing
    # it (launch splits the memory between workers of a device), under the chat workload (~8 min)
    run scaling 540 pdserve bench scaling --model dummy:llama-1b --devices cuda:0 --workers 2 \
        --topologies 1mono,2mono,1p1d --workload chat --duration 8 --refine 2 --out-dir "$OUT/scaling" "$CTX"
    grep -v '^{' "$OUT/scaling.log" | tail -n 20
    ;;
prefill-rows)
    # issue 11's prefill (31% of matmul peak on 2026-11-27, its attention 3.6 of 13.4 ms of kernels):
    # a prefill chunk's attention in each tile `auto` may choose, forced, its kernels beside the
    # decode's own 16-row tile, then the GPU invariance tests (chunked prompts) with 64 rows on 2 warps
    # (Triton keeps the older mma there, as in a decode's tile: the bits should hold)
    for tile in 16,0 32,0 64,2 128,2; do
        run "prefill-${tile/,/w}" 100 python3 -c "import sys, common.attention.triton_paged as tp
tp.choose_prefill_tile = lambda *a, **k: (($tile), ['forced by gpu_session.sh'])
from common.cli import run
sys.argv = ['pdserve', 'bench', 'step-profile', '--device', 'cuda:0', '--model', 'dummy:llama-1b', '--max-model-len',
            '4096', '--batch-sizes', '1', '--kv-len', '64', '--steps', '4', '--modes', 'invariant', '--prefill-len', '2048']
run()"
        grep -A5 "^prefill of one" "$OUT/prefill-${tile/,/w}.log" | head -n 6
    done
    run invariance-64w2 240 python3 -c "import sys, pytest, common.attention.triton_paged as tp
tp.choose_prefill_tile = lambda *a, **k: ((64, 2), ['forced by gpu_session.sh'])  # auto's engines
sys.exit(pytest.main('$ONE_PROCESS -p no:cacheprovider -m gpu tests/test_gpu.py -q'.split() +
                    ['-k', 'chunking or batch_invariant or graph_replay']))"
    tail -n 3 "$OUT/invariance-64w2.log"
    ;;
tiles)
    run tiles 200 python3 -m bench.matmul_tiles --model dummy:llama-1b
    run attention-tiles 120 python3 -m bench.attention_tiles
    grep -v '^{' "$OUT/tiles.log" | tail -n 75
    grep -v '^{' "$OUT/attention-tiles.log" | tail -n 12
    ;;
router)
    # how many GPU decode workers one router feeds, on a server's cores (the CI machine has 2)
    # (HTTP in the router, then from 4 API servers: --api-server-count on a host with cores to spare)
    for frontend in zmq http http4; do
        run "router-$frontend" 120 pdserve bench router --frontend "${frontend%4}" --workers 4 \
            --concurrency 64,256,1024 $([[ $frontend == http4 ]] && echo --api-servers 4)
        grep -v '^{' "$OUT/router-$frontend.log" | tail -n 8
    done
    ;;
speculative)
    # a random model's drafts are rarely kept: this shows what a draft's eager chunk costs beside the graphs
    run speculative 240 pdserve bench speculative --device cuda:0 --model dummy:llama-1b --max-model-len 4096 \
        --batch-sizes 1,16 --max-tokens 64
    grep -v '^{' "$OUT/speculative.log" | tail -n 8
    ;;
*)
    echo "unknown stage $stage; allowed: first, check, engine, cluster, serve, prefix, overlap, profile, tiles, prefill-rows, verify, scaling, router, speculative" >&2
    exit 2
    ;;
esac
cat "$OUT/summary.txt"
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then  # only 8 files come back from $OUT: one archive of them all
    tar czf /tmp/pdserve-results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/pdserve-results.tgz "$OUT/results.tgz"
fi
