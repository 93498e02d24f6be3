"""GPU targets: the cards people own plan a shipped config deviceless for their compute capability."""

import pytest

import shardmem
from shardmem.errors import ConfigError
from shardmem.models.attention import resolve_attention
from shardmem.planning import cost
from shardmem.planning.targets import GPU_TARGETS, MIG_PROFILES, MIG_TARGETS, target_for_device_kind

# One card per compute capability is a fast test, on the newest JAX too (whose XLA may drop or change a
# capability); the others differ from it only in their figures.
NEW_TARGETS = [
    *(pytest.param(name, marks=pytest.mark.newest) for name in ("t4", "v100-16g", "rtx-3090", "rtx-4090",
                                                                 "h100-nvl")),
    *(pytest.param(name, marks=pytest.mark.slow) for name in ("v100-32g", "a10g", "rtx-a6000", "l4", "l40s")),
]  # fmt: skip
ONE_CARD = ["mesh.axes={data: 1, fsdp: 1, tensor: 1}"]


@pytest.fixture(scope="module")
def tiny_fp16():
    return shardmem.load_config("configs/tiny.yaml", overrides=[*ONE_CARD, "precision.compute=float16"])


@pytest.mark.parametrize("name", NEW_TARGETS)
def test_each_card_plans_the_tiny_model_deviceless(name, tiny_fp16):
    spec = GPU_TARGETS[name]
    report = shardmem.plan(tiny_fp16, target=name, count_remat_overhead=False)
    assert report.fits and report.devices == 1 and report.device_memory_bytes == spec.memory_bytes
    assert spec.description in report.target_label and report.step_time is not None
    # Neither flash kernel builds before Ampere (compute capability 8.0): auto is chunked there.
    flash = spec.compute_capability >= (8, 0)
    assert report.attention.startswith("pallas" if flash else "chunked")
    assert report.step_time.peak_flops == spec.peak_flops["bf16" if spec.has_bf16 else "f16"]
    assert not [w for w in report.warnings if "precision.compute" in w]


def test_bf16_on_a_card_without_it_says_to_use_float16():
    config = shardmem.load_config("configs/tiny.yaml", overrides=[*ONE_CARD, "precision.compute=bfloat16"])
    report = shardmem.plan(config, target="t4", count_remat_overhead=False)
    (note,) = [w for w in report.warnings if "precision.compute" in w]
    assert "precision.compute=bfloat16" in note and "Tesla T4" in note and "no bf16" in note
    assert "set precision.compute=float16" in note


def test_cards_without_bf16_time_bf16_matmuls_at_the_float32_rate():
    t4 = cost.Hardware("t4", GPU_TARGETS["t4"].peak_flops, 320e9, 16e9, 1.5e9, 16e9)
    assert t4.peak("bf16") == 8.1e12 and t4.peak("f16") == 65e12 and t4.peak("s8") == 65e12
    assert t4.mfu_peak() == 65e12 and GPU_TARGETS["t4"].peak_bf16_flops == 65e12
    ampere = cost.Hardware("a10g", GPU_TARGETS["a10g"].peak_flops, 600e9, 32e9, 1.5e9, 32e9)
    assert ampere.peak("f8") == ampere.peak("bf16") == 70e12  # No FP8 units: as bf16.


def test_attached_cards_are_recognised_by_their_device_kind():
    kinds = {"NVIDIA GeForce RTX 4090": "rtx-4090", "NVIDIA GeForce RTX 3090": "rtx-3090", "NVIDIA L4": "l4",
             "NVIDIA L40S": "l40s", "NVIDIA A10G": "a10g", "NVIDIA RTX A6000": "rtx-a6000", "Tesla T4": "t4",
             "Tesla V100-SXM2-16GB": "v100-16g", "Tesla V100-SXM2-32GB": "v100-32g",
             "Tesla V100-PCIE-32GB": "v100-32g", "NVIDIA H100 NVL": "h100-nvl",
             "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H100 80GB HBM3": "h100-sxm",
             "NVIDIA H100 80GB HBM3 MIG 3g.40gb": "h100-sxm-mig-3g.40gb",
             "NVIDIA A100-SXM4-40GB MIG 1g.5gb": "a100-40g-mig-1g.5gb", "NVIDIA L40": None}  # fmt: skip
    assert {kind: target_for_device_kind(kind) for kind in kinds} == kinds


def test_flash_kernels_are_refused_before_ampere():
    assert resolve_attention("auto", chunk=None, where="pre-ampere-gpu", dtype="float16").name == "chunked"
    for kernel in ("cudnn", "pallas"):
        with pytest.raises(ConfigError, match=f"model.attention={kernel}: .*compute capability 8.0"):
            resolve_attention(kernel, chunk=None, where="pre-ampere-gpu", dtype="float16")


def test_mig_slices_are_rows_of_their_gpus_share_of_sms_and_memory():
    """NVIDIA's MIG user guide: A100, H100 and H200 split into sevenths of the SMs and eighths of the memory;
    an instance has no NVLink to another, so collectives between instances go over the GPU's PCIe link,
    which its instances share (issue 41)."""
    assert set(MIG_PROFILES) == {"a100-40g", "a100-80g", "h100-sxm", "h100-pcie", "h200"}
    assert len(MIG_TARGETS) == 5 * 6
    h100, slice_ = GPU_TARGETS["h100-sxm"], MIG_TARGETS["h100-sxm-mig-3g.40gb"]
    assert (
        slice_.memory_bytes == h100.memory_bytes // 2
        and slice_.memory_bandwidth == h100.memory_bandwidth // 2
    )
    assert slice_.sm_count == 132 * 3 // 7 and slice_.peak_flops["bf16"] == pytest.approx(989.4e12 * 56 / 132)
    assert slice_.nvlink_bandwidth == h100.host_bandwidth / 2 and not slice_.nvls  # Two per GPU, on PCIe.
    assert slice_.gpus_per_node == 16 and slice_.description == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    assert MIG_TARGETS["a100-40g-mig-1g.5gb"].memory_bytes == GPU_TARGETS["a100-40g"].memory_bytes // 8
    assert MIG_TARGETS["h200-mig-7g.141gb"].memory_bytes == GPU_TARGETS["h200"].memory_bytes


@pytest.mark.newest  # A deviceless GPU compile.
def test_a_mig_slice_plans_deviceless_and_with_the_plan_command(capsys):
    from shardmem.cli import main

    config = shardmem.load_config("configs/tiny.yaml", overrides=[*ONE_CARD, "precision.compute=float16"])
    report = shardmem.plan(config, target="a100-80g-mig-1g.10gb", count_remat_overhead=False)
    spec = MIG_TARGETS["a100-80g-mig-1g.10gb"]
    assert report.fits and report.device_memory_bytes == spec.memory_bytes
    assert "NVIDIA A100-SXM4-80GB MIG 1g.10gb" in report.target_label
    assert report.step_time.peak_flops == spec.peak_flops["bf16"] == pytest.approx(312e12 * 15 / 108)
    with pytest.raises(SystemExit):
        main(["plan", "configs/tiny.yaml", "--target", "h100-sxm-mig-3g.4gb"])
    err = capsys.readouterr().err
    assert "did you mean h100-sxm-mig-3g.40gb" in err and "shardmem policies lists them" in err


@pytest.mark.newest  # XLA's memory limit is XLA's: its rule may change with the version.
def test_a_deviceless_gpu_compile_works_within_the_memory_the_runs_allocator_will_hold():
    """XLA rematerializes (and schedules) within the memory its compile is told the allocator holds. On an
    attached GPU JAX tells it the allocator's limit, which ``shardmem train`` sets to
    ``memory.usable_fraction`` of the device; deviceless, XLA took 80% of the device's memory whatever the
    config said. Here the step's temporaries (7.2 GiB on a 9.9 GiB MIG slice) exceed XLA's limit at a
    usable fraction of 0.75, so XLA clones kernels to recompute values, and fit it at 0.95: fewer clones
    (JAX 0.10.2: 53 and none; 0.12: 12 and 2). With 80% for both, both plans had the same 18."""
    sets = [*ONE_CARD, "mesh.devices_per_host=1", "remat.policy=none", "remat.layers={}",
            "model.seq_len=4096", "train.global_batch=32", "memory.target=h100-sxm-mig-1g.10gb"]  # fmt: skip
    clones = {}
    for fraction in (0.75, 0.95):
        fraction_set = f"memory.usable_fraction={fraction}"
        config = shardmem.load_config("configs/tiny.yaml", overrides=[*sets, fraction_set])
        report = shardmem.plan(config, count_remat_overhead=False)
        instructions = (i for computation in report.module.computations.values() for i in computation)
        clones[fraction] = sum(".remat" in i.name for i in instructions)
        assert 7 << 30 < report.per_device["temp"] < 7.5 * (1 << 30)
    assert clones[0.75] > clones[0.95]
