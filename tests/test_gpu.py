"""GPU tests: the data plane on NCCL (the control plane stays on gloo) and every CUDA code path of the package.

``@pytest.mark.gpu`` tests need one CUDA device, ``@pytest.mark.gpu(devices=2)`` tests two; elsewhere each is skipped
with a reason naming that count (tests/conftest.py). ``make test-gpu`` runs them, on a self-hosted GPU runner in CI
(.github/workflows/gpu.yml). The CUDA paths covered: NCCL at world size 1 and 2, the device check by CUDA UUID (two
ranks on one GPU, made the ways it happens: two "nodes" on one host, a permuted ``CUDA_VISIBLE_DEVICES``), on-device
fingerprints, CUDA RNG capture and restore, ``map_location`` onto each rank's device, overlapped asynchronous
snapshots of CUDA tensors, exact evaluation and the monitored barrier over NCCL.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.proc import SCRIPTS, Run, run_scenario, run_script, torchrun_two_nodes
from tests.test_exact_eval import SOME_SIZES, assert_same, sample_counts

multiprocess = pytest.mark.multiprocess

#: cuBLAS picks deterministic kernels with a fixed workspace, so two fits of one configuration match bit for bit.
GPU_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def visible_gpus(n: int) -> list[str]:
    """The first ``n`` CUDA devices this process may use, as ``CUDA_VISIBLE_DEVICES`` entries."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e for e in visible.split(",") if e] if visible else [str(i) for i in range(torch.cuda.device_count())]
    assert len(entries) >= n, f"needs {n} visible CUDA devices, has {entries}"
    return entries[:n]


def weights_diff(a: Path, b: Path) -> float:
    x, y = torch.load(a, map_location="cpu", weights_only=True), torch.load(b, map_location="cpu", weights_only=True)
    assert x.keys() == y.keys()
    return max((x[k].double() - y[k].double()).abs().max().item() for k in x)


def ok(run: Run) -> Run:
    assert run.returncode == 0 and not run.timed_out and not run.orphans, run.describe()
    return run


def two_nodes_on_this_host(tmp_path: Path, *args: str, env: dict[str, str]) -> list[Run]:
    """scenario.py fit_ok as two torchrun "nodes" of one process each, both started on this host with
    ``Trainer(accelerator="gpu", devices=1, num_nodes=2)``: each process gets ``LOCAL_RANK=0`` and so ``cuda:0``."""
    return torchrun_two_nodes(tmp_path, "--accelerator", "gpu", *args, env=env, timeout=180)


def duplicate_device_message(device: str, local_ranks: tuple[int, int]) -> re.Pattern[str]:
    """The DuplicateDeviceError naming ranks 0 and 1, their local ranks, this host and ``device``."""
    host = re.escape(socket.gethostname())
    a, b = local_ranks
    return re.compile(
        rf"DuplicateDeviceError: 2 ranks were placed on the same device {re.escape(device)} of host '{host}': "
        rf"rank 0 \(local rank {a}, pid \d+\), rank 1 \(local rank {b}, pid \d+\)\. DDP needs one device per rank"
    )


NCCL_DUPLICATE = "Duplicate GPU detected : rank"  # NCCL's own message (ours quotes only "Duplicate GPU detected")


# ---------------------------------------------------------------------------------------------- one GPU


@pytest.mark.gpu
@multiprocess
def test_fit_on_one_gpu_runs_nccl_and_passes_the_handshake(tmp_path):
    run = ok(run_scenario("fit_ok", tmp_path, "--accelerator", "gpu", "--devices", "1", env=GPU_ENV))
    assert "distributed_backend=nccl" in run.output
    assert "train handshake passed on 1 rank(s)" in run.output
    assert run.result is not None and run.result["world_size"] == 1 and run.result["global_step"] == 16
    assert "at exit: default process group initialized=False" in run.output  # the NCCL group is destroyed at exit


@pytest.mark.gpu
@multiprocess
def test_two_ranks_on_one_gpu_raise_duplicate_device_error_naming_both(tmp_path):
    """The launcher mistake behind "Duplicate GPU detected": two torchrun "nodes" started on one host with one
    visible GPU (the multi-node guide's two-terminal trial, with ``--accelerator gpu``). Both ranks get LOCAL_RANK=0,
    so both use cuda:0; every rank stops with DuplicateDeviceError naming both ranks, the host and the device, before
    NCCL ran anything."""
    env = {**GPU_ENV, "CUDA_VISIBLE_DEVICES": visible_gpus(1)[0]}
    runs = two_nodes_on_this_host(tmp_path, "--barrier-timeout", "60", env=env)
    expected = duplicate_device_message("cuda:0", (0, 0))
    for run in runs:  # the error on both nodes, each from its own rank
        assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
        assert expected.search(run.output), run.describe()
        assert NCCL_DUPLICATE not in run.output and "handshake passed" not in run.output, run.describe()
        assert run.seconds < 120, run.describe()


@pytest.mark.gpu
@multiprocess
def test_stock_lightning_two_ranks_on_one_gpu_fail_inside_nccl(tmp_path):
    """The same launch with stock DDPStrategy: NCCL's own "Duplicate GPU detected" (from its communicator set-up,
    which Lightning starts eagerly in init_process_group), naming ranks and a CUDA bus id, not the host."""
    env = {**GPU_ENV, "CUDA_VISIBLE_DEVICES": visible_gpus(1)[0], "NCCL_DEBUG": "WARN"}
    runs = two_nodes_on_this_host(tmp_path, "--strategy", "ddp", env=env)
    for run in runs:
        assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
        assert "DuplicateDeviceError" not in run.output, run.describe()
    assert NCCL_DUPLICATE in runs[0].output + runs[1].output, runs[0].describe() + runs[1].describe()


@pytest.mark.gpu
def test_fingerprints_computed_on_the_gpu_equal_the_same_digest_computed_on_the_cpu():
    """The handshake fingerprints accelerator tensors on the device (a plain and a position-weighted sum of the bits,
    modulo 2**31 - 1; CPU tensors get a CRC-32 instead). The integers computed on the GPU equal the same digest
    computed on the CPU for every dtype and layout, and still change with one flipped bit or two swapped values."""
    from ddp_strategy.fingerprint import _CHUNK, _digest, fingerprint_tensors
    from ddp_strategy.handshake import collect_facts

    g = torch.Generator().manual_seed(0)
    tensors = {
        "float32, several chunks": torch.randn(2 * _CHUNK + 77, generator=g),
        "float64": torch.randn(1000, dtype=torch.float64, generator=g),
        "float16": torch.randn(333, generator=g).half(),
        "bfloat16": torch.randn(333, generator=g).bfloat16(),
        "int8": torch.randint(-128, 128, (999,), dtype=torch.int8, generator=g),
        "uint8": torch.randint(0, 256, (999,), dtype=torch.uint8, generator=g),
        "int64": torch.randint(-(2**62), 2**62, (500,), dtype=torch.int64, generator=g),
        "bool": torch.rand(777, generator=g) > 0.5,
        "complex64": torch.randn(100, dtype=torch.complex64, generator=g),
        "transposed": torch.randn(64, 32, generator=g).t(),
        "empty": torch.empty(0),
        "scalar": torch.tensor(3.5),
        "nan and signed zeros": torch.tensor([float("nan"), -0.0, 0.0]),
    }
    named = [(name, "parameter", t) for name, t in tensors.items()]
    on_gpu = fingerprint_tensors([(n, k, t.cuda()) for n, k, t in named])
    for (name, _, cpu), fingerprint in zip(named, on_gpu, strict=True):
        expected = tuple(int(v) for v in _digest(cpu).tolist())
        assert fingerprint.digest == expected, name
        assert (fingerprint.shape, fingerprint.dtype) == (tuple(cpu.shape), str(cpu.dtype)), name

    def digest_on_gpu(t: torch.Tensor) -> Any:
        return fingerprint_tensors([("t", "parameter", t.cuda())])[0].digest

    x = torch.randn(5000, generator=g)
    flipped = x.clone()
    flipped.view(torch.int32)[4321] ^= 1  # the lowest mantissa bit of one value
    swapped = x.clone()
    swapped[[10, 20]] = swapped[[20, 10]]
    assert len({digest_on_gpu(x), digest_on_gpu(flipped), digest_on_gpu(swapped)}) == 3
    assert digest_on_gpu(torch.tensor([0.0])) != digest_on_gpu(torch.tensor([-0.0]))

    facts = collect_facts(
        rank=0, local_rank=0, node_rank=0, world_size=1, device=torch.device("cuda", 0),
        module=torch.nn.Linear(4, 3).cuda(),
    )  # fmt: skip
    assert facts.device == "cuda:0"
    assert facts.device_id is not None and facts.device_id.startswith("cuda-uuid:")  # the UUID, not the index
    assert [t.digest is not None for t in facts.tensors] == [True, True]


@pytest.mark.gpu
def test_cuda_rng_state_survives_a_checkpoint_loaded_onto_the_gpu(tmp_path):
    """rng.capture() includes the CUDA generators once CUDA is in use; a checkpoint loaded with map_location on the
    GPU (as the strategy loads it) brings the saved generator states to the GPU, and rng.restore() still puts them
    back: the same CPU and CUDA random numbers follow."""
    from ddp_strategy.checkpoint import rng
    from ddp_strategy.checkpoint.io import SafeCheckpointIO

    torch.zeros(1, device="cuda")  # CUDA in use
    before = rng.capture()
    try:
        torch.cuda.manual_seed_all(7)
        torch.manual_seed(7)
        state = rng.capture()
        assert "torch.cuda" in state and all(t.device.type == "cpu" for t in state["torch.cuda"])
        expected = (torch.rand(8, device="cuda").cpu(), torch.rand(8))
        path = tmp_path / "rng.ckpt"
        io = SafeCheckpointIO()
        io.save_checkpoint({"ddp_strategy": {"world_size": 1, "rng_states": [state]}}, path)
        loaded = io.load_checkpoint(path, map_location=torch.device("cuda", 0), weights_only=True)
        restored = loaded["ddp_strategy"]["rng_states"][0]
        assert restored["torch.cuda"][0].device.type == "cuda"  # map_location moved the saved states too
        torch.rand(8, device="cuda")  # the generators move on
        torch.rand(8)
        rng.restore(restored)
        again = (torch.rand(8, device="cuda").cpu(), torch.rand(8))
        assert torch.equal(expected[0], again[0]) and torch.equal(expected[1], again[1])
    finally:
        rng.restore(before)


@pytest.mark.gpu
@multiprocess
def test_stock_lightning_resume_on_a_gpu_is_not_exact(tmp_path):
    """Stock DDPStrategy keeps no RNG state: the resumed fit's dropout draws from a freshly seeded CUDA generator."""
    args = ["--accelerator", "gpu", "--devices", "1", "--strategy", "ddp"]
    full, resumed, ckpt = tmp_path / "full.pt", tmp_path / "resumed.pt", str(tmp_path / "ckpt")
    ok(run_scenario("fit_ok", tmp_path, *args, "--max-epochs", "4", "--save-weights", str(full), env=GPU_ENV))
    ok(run_scenario("fit_ok", tmp_path, *args, "--max-epochs", "2", "--ckpt-dir", ckpt, env=GPU_ENV))
    ok(run_scenario("fit_ok", tmp_path, *args, "--max-epochs", "4", "--ckpt-dir", ckpt, "--resume", "last",
                    "--save-weights", str(resumed), env=GPU_ENV))  # fmt: skip
    assert weights_diff(full, resumed) > 0.0


@pytest.mark.gpu
@multiprocess
def test_a_gpu_checkpoint_resumes_on_cpu_ranks_with_every_tensor_on_the_cpu(tmp_path):
    """Written by a GPU run (its tensors are CUDA tensors in the file), resumed by 2 CPU ranks: each rank's
    ``load_checkpoint`` maps every tensor to its own device, the CPU."""
    ckpt, report = tmp_path / "ckpt", tmp_path / "loaded"
    common = ["--optimizer", "adam", "--ckpt-dir", str(ckpt)]
    ok(run_scenario("fit_ok", tmp_path, "--accelerator", "gpu", "--devices", "1", "--max-epochs", "1", *common,
                    env=GPU_ENV))  # fmt: skip
    saved = torch.load(ckpt / "last.ckpt", weights_only=True)  # no map_location: where the tensors were saved from
    assert saved["state_dict"]["net.0.weight"].device.type == "cuda"
    run = ok(run_scenario("fit_ok", tmp_path, "--devices", "2", "--max-epochs", "2", "--resume", "last",
                          "--load-report", str(report), *common))  # fmt: skip
    assert "Restored all states from the checkpoint" in run.output
    for rank in (0, 1):
        assert json.loads((report / f"rank{rank}.json").read_text()) == {"root_device": "cpu", "devices": ["cpu"]}


# ---------------------------------------------------------------------------------------------- one GPU, or two


@pytest.mark.parametrize(
    "devices", [pytest.param(1, marks=pytest.mark.gpu), pytest.param(2, marks=pytest.mark.gpu(devices=2))]
)
@multiprocess
def test_resume_on_gpus_is_bit_exact_with_the_cuda_rng_restored(tmp_path, devices):
    """4 epochs straight against 2 epochs, stop, resume from last.ckpt to 4: equal weights. The model's dropout runs
    on the GPU, drawing from the CUDA generator, so this needs each rank's CUDA RNG state saved and restored."""
    common = ["--accelerator", "gpu", "--devices", str(devices)]
    full, resumed, ckpt = tmp_path / "full.pt", tmp_path / "resumed.pt", tmp_path / "ckpt"
    ok(run_scenario("fit_ok", tmp_path, *common, "--max-epochs", "4", "--save-weights", str(full), env=GPU_ENV))
    ok(run_scenario("fit_ok", tmp_path, *common, "--max-epochs", "2", "--ckpt-dir", str(ckpt), env=GPU_ENV))
    saved = torch.load(ckpt / "last.ckpt", map_location="cpu", weights_only=True)["ddp_strategy"]
    assert saved["world_size"] == devices and len(saved["rng_states"]) == devices
    assert all(len(state["torch.cuda"]) >= 1 for state in saved["rng_states"])  # every rank's CUDA generators
    run = ok(run_scenario("fit_ok", tmp_path, *common, "--max-epochs", "4", "--ckpt-dir", str(ckpt), "--resume", "last",
                          "--save-weights", str(resumed), env=GPU_ENV))  # fmt: skip
    assert "Restored all states from the checkpoint" in run.output
    assert run.result is not None and run.result["global_step"] == 4 * math.ceil(64 / devices / 8)
    assert weights_diff(full, resumed) == 0.0


@pytest.mark.parametrize(
    "devices", [pytest.param(1, marks=pytest.mark.gpu), pytest.param(2, marks=pytest.mark.gpu(devices=2))]
)
@multiprocess
def test_overlapped_async_snapshot_of_cuda_tensors_resumes_bit_exact(tmp_path, devices):
    """async_save with async_snapshot="overlap" (the default): step checkpoints whose parameters and Adam state are
    copied from the GPU by the writer thread while the next forward and backward run; the interrupted and the
    resumed run both overlapped, and the resumed weights equal the uninterrupted run's."""
    common = ["--accelerator", "gpu", "--devices", str(devices), "--batchnorm", "--optimizer", "adam"]
    full, resumed, ckpt = tmp_path / "full.pt", tmp_path / "resumed.pt", str(tmp_path / "ckpt")
    saves = ["--every-n-train-steps", "5", "--ckpt-dir", ckpt, "--async-save"]
    ok(run_scenario("fit_ok", tmp_path, *common, "--max-epochs", "4", "--save-weights", str(full), env=GPU_ENV))
    runs = [
        ok(run_scenario("fit_ok", tmp_path, *common, "--max-epochs", "4", "--max-steps", "5", *saves, env=GPU_ENV)),
        ok(run_scenario("fit_ok", tmp_path, *common, "--max-epochs", "4", *saves, "--resume", "last",
                        "--save-weights", str(resumed), env=GPU_ENV)),
    ]  # fmt: skip
    for run in runs:
        assert run.result is not None and run.result["overlapped_saves"] >= 1, run.describe()
    assert "Restored all states from the checkpoint" in runs[1].output
    assert weights_diff(full, resumed) == 0.0


# ---------------------------------------------------------------------------------------------- two GPUs


@pytest.mark.gpu(devices=2)
@multiprocess
def test_fit_on_two_gpus_runs_nccl_and_passes_the_handshake(tmp_path):
    run = ok(run_scenario("fit_ok", tmp_path, "--accelerator", "gpu", "--devices", "2", env=GPU_ENV))
    assert "distributed_backend=nccl" in run.output
    assert "train handshake passed on 2 rank(s)" in run.output
    assert run.result is not None and run.result["world_size"] == 2
    assert run.output.count("at exit: default process group initialized=False") == 2  # on both ranks
    assert "ShardingCheck" not in run.output  # on by default; batches hashed on the GPU, correctly sharded


@pytest.mark.gpu(devices=2)
@multiprocess
def test_rank0_only_barrier_raises_with_an_nccl_data_plane(tmp_path):
    args = ["--accelerator", "gpu", "--devices", "2", "--barrier-timeout", "5"]
    run = run_scenario("barrier_rank0_only", tmp_path, *args, timeout=120, env=GPU_ENV)
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    for needle in (
        "CollectiveMismatchError",
        "barrier 'only_rank0'",
        "rank(s) 1 never arrived",
        "rank 1: training step 2",
    ):
        assert needle in run.output, run.describe()


@pytest.mark.gpu(devices=2)
@multiprocess
def test_every_rank_loads_the_checkpoint_onto_its_own_gpu(tmp_path):
    """Rank 0 writes the checkpoint from cuda:0; at resume every rank's copy of every tensor is on its own GPU (rank
    1's on cuda:1: without map_location torch.load would put it on cuda:0, where rank 0 trains)."""
    ckpt, report = tmp_path / "ckpt", tmp_path / "loaded"
    common = ["--accelerator", "gpu", "--devices", "2", "--optimizer", "adam", "--ckpt-dir", str(ckpt)]
    ok(run_scenario("fit_ok", tmp_path, *common, "--max-epochs", "1", env=GPU_ENV))
    saved = torch.load(ckpt / "last.ckpt", weights_only=True)  # no map_location: where the tensors were saved from
    assert saved["state_dict"]["net.0.weight"].device == torch.device("cuda", 0)
    run = ok(run_scenario("fit_ok", tmp_path, *common, "--max-epochs", "2", "--resume", "last", "--load-report",
                          str(report), env=GPU_ENV))  # fmt: skip
    assert "Restored all states from the checkpoint" in run.output
    for rank in (0, 1):
        device = f"cuda:{rank}"
        assert json.loads((report / f"rank{rank}.json").read_text()) == {"root_device": device, "devices": [device]}


@pytest.mark.gpu(devices=2)
@multiprocess
def test_permuted_cuda_visible_devices_put_two_ranks_on_one_gpu(tmp_path):
    """A per-rank CUDA_VISIBLE_DEVICES mistake: rank 1 sees the two GPUs in the other order, so its cuda:1 is rank 0's
    cuda:0. The device names differ; the device check compares CUDA UUIDs and names both ranks."""
    first, second = visible_gpus(2)
    swap = (
        'if [ "$LOCAL_RANK" = 1 ]; then export CUDA_VISIBLE_DEVICES="$SWAPPED"; fi; '
        'echo "local rank $LOCAL_RANK: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"; exec "$0" "$@"'
    )
    out = tmp_path / "swapped.json"
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python", "sh", "-c", swap]
    cmd += [sys.executable, str(SCRIPTS / "scenario.py"), "fit_ok", "--out", str(out), "--accelerator", "gpu"]
    cmd += ["--devices", "2"]
    env = {**GPU_ENV, "CUDA_VISIBLE_DEVICES": f"{first},{second}", "SWAPPED": f"{second},{first}"}
    run = run_script(cmd, timeout=180, out=out, env=env)
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    assert f"local rank 1: CUDA_VISIBLE_DEVICES={second},{first}" in run.output, run.describe()
    assert duplicate_device_message("cuda:0", (0, 1)).search(run.output), run.describe()
    assert NCCL_DUPLICATE not in run.output


@pytest.mark.gpu(devices=2)
@multiprocess
def test_exact_evaluation_over_nccl_matches_one_gpu(tmp_path):
    """validate/test/predict/fit on 2 GPUs (metric states and sync_dist reductions on CUDA over NCCL, empty shards
    included) give the results of one GPU: counts exactly, floats within 1e-6, predictions in order."""
    script = str(SCRIPTS / "exact_eval.py")
    args = ["--accelerator", "gpu", "--sizes", SOME_SIZES]
    results = {}
    for devices in (1, 2):
        out = tmp_path / f"gpus{devices}.json"
        run = run_script([script, *args, "--devices", str(devices), "--out", str(out)], timeout=400, out=out,
                         env=GPU_ENV)  # fmt: skip
        assert run.returncode == 0 and not run.orphans and run.result is not None, run.describe()
        results[devices] = run.result
    assert results[2]["world_size"] == 2
    expected_counts = [float(n) for n, _ in results[2]["configs"] if n > 0]
    assert sample_counts(results[2]["test"]) == expected_counts
    for stage in ("validate", "test", "predict", "fit"):
        assert_same(results[1][stage], results[2][stage], stage)
