"""Workers sharing a GPU, on CPU with made-up numbers: how a device is split between the workers
placed on it (common/memory.py, both launchers), how many KV blocks a share leaves, and the clear
error of a worker whose share or the device's free memory is too small."""

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.model_spec import model_config
from common.config import EngineConfig
from common.errors import InvalidArgument
from common.memory import (CONTEXT_BYTES, DEFAULT_UTILIZATION, SAMPLER_BYTES_PER_LOGIT, DeviceMemory, block_cost,
                           decode_graph_bytes, device_shares, kv_pool_blocks, launch_plan, pool_and_context,
                           step_activation_bytes, triton_prefill_bytes)
from router.launcher import Cluster

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
H100 = 79 * GiB  # about what an H100 80GB reports as its total


# ----------------------------------------------------------------------------- splitting a device

def test_a_launch_on_a_cpu_and_gpus_needs_one_dtype_for_all():
    """A CPU worker computes in float32 by default and a GPU worker in bfloat16: the router refuses
    a second dtype, so a launch that mixes them says so before it starts anything."""
    with pytest.raises(InvalidArgument, match="give every worker one --dtype") as e:
        launch_plan(1, 1, 0, ["cpu", "cuda:0"], [])
    assert e.value.param == "--dtype"
    assert [d for _, d, _ in launch_plan(1, 1, 0, ["cpu", "0"], ["--dtype=float32"])] == ["cpu", "0"]
    assert [d for _, d, _ in launch_plan(1, 1, 0, ["cuda:0", "0"], [])] == ["cuda:0", "0"]  # GPUs alike
    assert [d for _, d, _ in launch_plan(1, 0, 0, ["cpu", "cuda:0"], [])] == ["cpu"]  # the GPU is not used


def test_one_prefill_one_decode_on_one_gpu_split_it_decode_larger():
    prefill, decode = device_shares(["prefill", "decode"], ["cuda:0", "cuda:0"])
    assert decode > prefill > 0
    assert prefill + decode <= DEFAULT_UTILIZATION
    assert prefill + decode > DEFAULT_UTILIZATION - 0.001  # nothing of the default left unused


def test_shares_follow_the_devices_workers_land_on():
    roles = ["prefill", "prefill", "decode", "decode"]
    # in turn over two GPUs: each holds one prefill and one decode worker, split as a 1P1D alone
    p, d = device_shares(["prefill", "decode"], ["cuda:0", "cuda:0"])
    two_gpus = device_shares(roles, ["cuda:0", "cuda:1", "cuda:0", "cuda:1"])
    assert two_gpus == [p, p, d, d]
    one_gpu = device_shares(roles, ["cuda:0"] * 4)
    assert [2 * s for s in one_gpu] == pytest.approx(two_gpus, abs=2e-4)  # twice the workers, half each
    assert device_shares(["mono"], ["cuda:0"]) == [DEFAULT_UTILIZATION]
    assert device_shares(["prefill", "decode"], ["cpu", "cpu"]) == [None, None]  # a CPU pool has no share
    # 'cuda', 'cuda:0' and '0' are one device; a CPU worker beside them takes nothing of it
    assert device_shares(["prefill", "decode", "decode"], ["cuda", "0", "cpu"]) == \
        device_shares(["prefill", "decode"], ["cuda:0", "cuda:0"]) + [None]


@pytest.mark.parametrize("seed", range(20))
def test_shares_of_a_device_never_add_up_past_the_default(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    roles = [rng.choice(["prefill", "decode", "mono"]) for _ in range(n)]
    devices = [rng.choice(["cpu", "cuda:0", "cuda:1", "2"]) for _ in range(n)]
    shares = device_shares(roles, devices)
    by_device: dict[str, list] = {}
    for role, device, share in zip(roles, devices, shares):
        assert (share is None) == (device == "cpu")
        if share is not None:
            by_device.setdefault(device, []).append((role, share))
    for placed in by_device.values():
        assert sum(s for _, s in placed) <= DEFAULT_UTILIZATION + 1e-9  # shares are rounded down
        prefill = [s for r, s in placed if r == "prefill"]
        decode = [s for r, s in placed if r != "prefill"]
        if prefill and decode:
            assert min(decode) > max(prefill)


# ----------------------------------------------------------------------------- the pool a share leaves

LLAMA_1B = model_config("dummy:llama-1b")
BLOCK = LLAMA_1B.kv_values_per_token * 16 * 2  # 16 tokens of bfloat16 KV
ACT = step_activation_bytes(LLAMA_1B, 2048, 64, LLAMA_1B.max_position_embeddings, 2)
WEIGHTS = int(2.47e9)


def blocks_for(share, free, held=WEIGHTS + CONTEXT_BYTES, min_blocks=128, **kw):
    mem = DeviceMemory("cuda:0", H100, free, held)
    return kv_pool_blocks(mem, BLOCK, LLAMA_1B.num_layers, ACT, min_blocks, 10**9, share, **kw)


def test_workers_starting_together_size_from_their_share_not_from_what_is_free():
    prefill_share, decode_share = device_shares(["prefill", "decode"], ["cuda:0", "cuda:0"])
    held = WEIGHTS + CONTEXT_BYTES
    # the decode worker sizes first, or after the prefill worker took its pool: the same pool
    early = blocks_for(decode_share, free=H100 - 2 * held)
    late = blocks_for(decode_share, free=H100 - 2 * held - blocks_for(prefill_share, H100 - 2 * held) * BLOCK - ACT)
    assert early == late
    prefill = blocks_for(prefill_share, free=H100 - 2 * held - early * block_cost(BLOCK, 16) - ACT)
    assert early > prefill > 0
    # both fit in the device at once, activations included, with the default's headroom left
    used = 2 * (held + ACT) + (early + prefill) * block_cost(BLOCK, LLAMA_1B.num_layers)
    assert used <= DEFAULT_UTILIZATION * H100
    assert used > DEFAULT_UTILIZATION * H100 - 2 * BLOCK * 2  # and the shares are used, not left idle


def test_a_pool_is_what_the_share_leaves_after_weights_and_activations():
    got = blocks_for(0.5, free=H100 - WEIGHTS - CONTEXT_BYTES)
    assert got == int((0.5 * H100 - WEIGHTS - CONTEXT_BYTES - ACT) // block_cost(BLOCK, LLAMA_1B.num_layers))
    assert blocks_for(0.5, free=H100, min_blocks=1, held=WEIGHTS + CONTEXT_BYTES + 8 * GiB) < got  # more held


def test_activations_cover_what_one_step_allocates_for_sure():
    """At least the float32 logits of every sampled row and a full context's gathered K and V."""
    bf16 = step_activation_bytes(LLAMA_1B, 2048, 64, 4096, 2)
    assert bf16 >= 64 * LLAMA_1B.vocab_size * 4 + 2 * 4096 * LLAMA_1B.num_kv_heads * LLAMA_1B.head_dim * 2
    assert step_activation_bytes(LLAMA_1B, 4096, 64, 4096, 2) > bf16  # grows with the token budget
    assert step_activation_bytes(LLAMA_1B, 2048, 64, 4096, 4) > bf16  # and the dtype


def test_decode_graphs_reserve_their_partials_for_a_full_context():
    """The Triton attention's float32 partials in the graphs' pool: a row per 256-key split its
    tables hold per head, for every row of the largest batch, beside its activations."""
    from common.attention import triton_paged

    partials = 64 * 32 * 512 * (64 + 1) * 4  # 131,072 tokens: 512 splits
    samplers = 64 * LLAMA_1B.vocab_size * SAMPLER_BYTES_PER_LOGIT  # the captured samplers' own pool
    assert decode_graph_bytes(LLAMA_1B, 64, 131072, 2) == (step_activation_bytes(LLAMA_1B, 64, 64, 0, 2) + partials
                                                            + samplers)
    shorter = 64 * 32 * (512 - 20) * (64 + 1) * 4  # 5,000 tokens: 20 splits
    assert decode_graph_bytes(LLAMA_1B, 64, 131072, 2) - decode_graph_bytes(LLAMA_1B, 64, 5000, 2) == shorter
    assert triton_paged.max_splits_for(-(-5000 // 16), 16) == 20  # the graphs' rows per token
    assert triton_paged.SPLIT == 256  # the split decode_graph_bytes counts by
    # an eager step of 2,048 chunk tokens at the end of llama-1b's full context: 512 splits each
    assert triton_prefill_bytes(LLAMA_1B, 2048, 131072) == 2048 * 512 * 32 * 65 * 4


def llama_1b_activations(context: int) -> int:
    """What a bfloat16 llama-1b worker with the Triton attention and decode graphs reserves for a
    step attending over `context` tokens (common/engine.py's sum)."""
    return (step_activation_bytes(LLAMA_1B, 2048, 64, context, 2) + triton_prefill_bytes(LLAMA_1B, 2048, context)
            + decode_graph_bytes(LLAMA_1B, 64, context, 2))


def test_a_pool_smaller_than_the_context_bounds_the_context_the_activations_are_sized_for():
    """2P2D of llama-1b on one H100: a prefill worker's share (0.15) cannot hold the activations
    of a step over the model's whole 131,072-token context; no sequence outgrows the pool, so the
    worker sizes them for what its pool holds, and gets a pool that holds at least that context."""
    full = LLAMA_1B.max_position_embeddings
    share = device_shares(["prefill", "prefill", "decode", "decode"], ["cuda:0"] * 4)[0]
    mem = DeviceMemory("cuda:0", H100, H100 - WEIGHTS - CONTEXT_BYTES, WEIGHTS + CONTEXT_BYTES)
    with pytest.raises(InvalidArgument):  # sized for the whole context, nothing is left for a pool
        kv_pool_blocks(mem, BLOCK, LLAMA_1B.num_layers, llama_1b_activations(full), 128, 10**9, share)
    blocks, context = pool_and_context(mem, BLOCK, 16, LLAMA_1B.num_layers, llama_1b_activations, full, 128,
                                       10**9, share)
    assert context == blocks * 16 < full  # the context is what the pool holds
    assert blocks >= 1000  # a useful pool: more than a few requests' worth
    used = WEIGHTS + CONTEXT_BYTES + blocks * block_cost(BLOCK, LLAMA_1B.num_layers) + llama_1b_activations(context)
    assert used <= share * H100  # within the share, the step's activations at that context included
    # the largest safe pool: sized for a context a block shorter, the pool would hold more than it
    assert kv_pool_blocks(mem, BLOCK, LLAMA_1B.num_layers, llama_1b_activations(context - 16), 128, 10**9,
                          share) * 16 > context - 16
    # a share whose pool holds the whole context keeps it
    big = pool_and_context(mem, BLOCK, 16, LLAMA_1B.num_layers, llama_1b_activations, full, 128, 10**9, 0.9)
    assert big[1] == full and big[0] * 16 >= full
    # a pool sized by --kv-cache-gb bounds the context alike
    blocks, context = pool_and_context(mem, BLOCK, 16, LLAMA_1B.num_layers, llama_1b_activations, full, 128, 10**9,
                                       None, 2 * GiB)
    assert (blocks, context) == (2 * GiB // BLOCK, 2 * GiB // BLOCK * 16)


def test_no_share_given_takes_the_default_and_no_more_than_is_free():
    alone = blocks_for(None, free=H100 - WEIGHTS - CONTEXT_BYTES)
    assert alone == blocks_for(DEFAULT_UTILIZATION, free=H100 - WEIGHTS - CONTEXT_BYTES)
    crowded = blocks_for(None, free=10 * GiB)  # a second engine in this process holds the rest
    assert 0 < crowded * block_cost(BLOCK, LLAMA_1B.num_layers) + ACT <= 10 * GiB
    with pytest.raises(InvalidArgument):
        blocks_for(0.9, free=10 * GiB)  # a share the device cannot give: an error, not a smaller pool


def test_kv_cache_gb_sizes_the_pool_itself():
    assert blocks_for(None, free=H100 // 2, kv_cache_bytes=8 * GiB) == 8 * GiB // BLOCK
    with pytest.raises(InvalidArgument, match=r"lower --kv-cache-gb \(it asks for 64.00 GiB\)"):
        blocks_for(None, free=20 * GiB, kv_cache_bytes=64 * GiB)


def test_a_share_too_small_for_weights_and_a_minimal_pool_fails_naming_device_memory_and_flag():
    with pytest.raises(InvalidArgument) as e:
        blocks_for(0.04, free=H100 - WEIGHTS - CONTEXT_BYTES)  # 3.16 GiB: the weights and context alone are 3.3
    msg = str(e.value)
    assert "cuda:0 has 79.00 GiB" in msg and "this worker holds 3.30 GiB" in msg
    assert "--gpu-memory-utilization=0.04 (3.16 GiB)" in msg and "raise --gpu-memory-utilization" in msg


def test_a_device_with_too_little_free_fails_naming_what_another_process_holds():
    with pytest.raises(InvalidArgument) as e:
        blocks_for(0.6, free=20 * GiB)  # something else holds most of the device
    msg = str(e.value)
    assert "20.00 GiB of it free" in msg and "lower --gpu-memory-utilization (it is 0.6: 47.40 GiB)" in msg
    with pytest.raises(InvalidArgument) as e:  # no share given: what is free limits the pool, not a flag
        blocks_for(None, free=ACT)
    msg = str(e.value)
    assert "0.9 of what is free leaves" in msg and "free the device, or size the pool with --kv-cache-gb" in msg
    assert "raise --gpu-memory-utilization" not in msg


def test_utilization_outside_zero_to_one_is_refused_clearly():
    for bad in (0, -0.5, 1.5):
        with pytest.raises(InvalidArgument, match=f"gpu_memory_utilization={bad}; allowed: a fraction in"):
            EngineConfig(gpu_memory_utilization=bad)
    EngineConfig(gpu_memory_utilization=0.5)  # on a CPU pool it is ignored (mixed --devices pass it to every worker)
    r = subprocess.run([sys.executable, "-m", "common.cli", "generate", "--prompt", "x", "--gpu-memory-utilization",
                        "2"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "Invalid value for '--gpu-memory-utilization': 2.0 is not in the range 0<x<=1" in \
        r.stderr, r.stderr


# ----------------------------------------------------------------------------- the launchers

def worker_shares(argvs: dict[str, list[str]]) -> dict[str, str | None]:
    out = {}
    for name, argv in argvs.items():
        i = argv.index("--gpu-memory-utilization") if "--gpu-memory-utilization" in argv else None
        out[name] = None if i is None else argv[i + 1]
    return out


def cluster_shares(devices, worker_args=(), prefill=1, decode=1, **kw) -> dict[str, str | None]:
    c = Cluster("dummy:nanogpt", prefill, decode, 0, devices, "127.0.0.1", 1, 2, Path("unused"), "least_loaded",
                list(worker_args), threads=1, **kw)
    return worker_shares({w.name: w.argv for w in c.workers})


def test_cluster_splits_each_gpu_between_its_workers_unless_a_memory_flag_sizes_them():
    assert cluster_shares(["cuda:0"]) == {"prefill-0": "0.3", "decode-0": "0.6"}
    assert cluster_shares(["cuda:0"], device_share=0.5) == {"prefill-0": "0.15", "decode-0": "0.3"}
    assert cluster_shares(["cpu"]) == {"prefill-0": None, "decode-0": None}
    for flag in (["--kv-cache-gb", "4"], ["--num-blocks=64"], ["--gpu-memory-utilization", "0.4"]):
        c = Cluster("dummy:nanogpt", 1, 1, 0, ["cuda:0"], "127.0.0.1", 1, 2, Path("unused"), "least_loaded", flag, 1)
        assert all(w.argv.count("--gpu-memory-utilization") == flag.count("--gpu-memory-utilization")
                   for w in c.workers)
        assert all(w.argv[-len(flag):] == flag for w in c.workers)
    assert not Path("unused").exists()  # building a cluster writes nothing: its log directory comes at start


def dry_run(cmd: list[str]) -> dict[str, list[str]]:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PDSERVE="python3 -m common.cli"))  # this tree's code
    assert r.returncode == 0, r.stderr
    lines = [re.match(r"([a-z]+-\d+|router): (.*)", line) for line in r.stdout.splitlines()]
    return {m[1]: m[2].split() for m in lines if m}


@pytest.mark.parametrize("devices, args, engine", [
    ("cuda:0", [], []),
    ("cuda:0,cuda:1", ["--prefill", "2", "--decode", "2"], []),
    ("cpu,0", ["--prefill", "2", "--decode", "1"], ["--dtype", "float32"]),  # one dtype: a CPU's and a GPU's differ
    ("cuda:0", ["--mono", "2", "--prefill", "0", "--decode", "0"], []),
])
def test_both_launchers_give_the_same_shares(devices, args, engine):
    launch = dry_run([sys.executable, "-m", "common.cli", "launch", "--devices", devices, "--dry-run", *args, *engine])
    script = dry_run(["bash", str(ROOT / "deploy" / "launch.sh"), "--devices", devices, "--dry-run", *args, "--",
                      *engine])
    launch.pop("router"), script.pop("router")
    assert worker_shares(launch) == worker_shares(script)
    assert any(s is not None for s in worker_shares(launch).values())
    assert [launch[w][launch[w].index("--device") + 1] for w in launch] == \
        [script[w][script[w].index("--device") + 1] for w in script]


def test_both_launchers_leave_a_pool_sized_by_the_user_alone():
    launch = dry_run([sys.executable, "-m", "common.cli", "launch", "--devices", "cuda:0", "--dry-run",
                      "--kv-cache-gb", "4"])
    script = dry_run(["bash", str(ROOT / "deploy" / "launch.sh"), "--devices", "cuda:0", "--dry-run", "--",
                      "--kv-cache-gb=4"])
    assert set(worker_shares(launch).values()) == set(worker_shares(script).values()) == {None}


@pytest.mark.parametrize("args, workers", [([], 2), (["--mono", "1", "--prefill", "0", "--decode", "0"], 1)])
def test_both_launchers_leave_a_core_to_the_router(args, workers):
    """Workers get (cores - 1) / workers torch threads, at least one, from either launcher."""
    want = str(max(1, ((os.cpu_count() or 1) - 1) // workers))
    launch = dry_run([sys.executable, "-m", "common.cli", "launch", "--dry-run", *args])
    script = dry_run(["bash", str(ROOT / "deploy" / "launch.sh"), "--dry-run", *args])
    launch.pop("router"), script.pop("router")
    for argv in (*launch.values(), *script.values()):
        assert argv[argv.index("--threads") + 1] == want, argv
    assert len(launch) == len(script) == workers


def test_both_launchers_take_the_same_flags():
    """The router's limits reach the router and --threads the workers, from either launcher."""
    args = ["--threads", "3", "--max-queue", "8", "--queue-timeout", "2.5", "--max-attempts", "5", "--no-restart"]
    launch = dry_run([sys.executable, "-m", "common.cli", "launch", "--dry-run", *args])
    script = dry_run(["bash", str(ROOT / "deploy" / "launch.sh"), "--dry-run", *args])
    for argv in (launch["router"], script["router"]):
        assert [argv[argv.index(flag) + 1] for flag in ("--max-queue", "--queue-timeout", "--max-attempts")] == \
            ["8", "2.5", "5"], argv
    assert all(argv[argv.index("--threads") + 1] == "3" for argv in (launch["prefill-0"], script["decode-0"]))
