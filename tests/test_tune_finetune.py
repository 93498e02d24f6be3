"""shardmem tune on a fine-tune (shardmem.explore.finetune), and the 24 GB-card bar's verdicts."""

import math
from pathlib import Path

import pytest

from shardmem import config_from_dict, load_config, plan
from shardmem.cli import main
from shardmem.errors import ConfigError
from shardmem.explore.tune import tune
from shardmem.models.llama import ModelConfig
from shardmem.planning.memory import make_target

ROOT = Path(__file__).resolve().parent.parent
ATTENTION = ["layers/wq", "layers/wk", "layers/wv", "layers/wo"]


def _tiny_lora(**finetune):
    return config_from_dict({
        "model": {"preset": "tiny", "n_layers": 2}, "mesh": {"axes": {"data": 8}},
        "remat": {"policy": "none"}, "precision": {"compute": "float32"},
        "train": {"global_batch": 8, "steps": 10},
        "finetune": {"lora": {"rank": 4, "alpha": 8, "targets": ATTENTION}, "base_dtype": "float32",
                     **finetune},
    })  # fmt: skip


def _with_budget(config, budget_bytes: int):
    memory = make_target(config, "cpu").memory_bytes
    return config.replace("memory.reserve=0", f"memory.usable_fraction={budget_bytes / memory!r}")


def _lora_bytes(rank: int, layers: int, d: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """float32 adapters: rank x (d_in + d_out) per adapted matrix, q/k/v/o in each layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return 4 * layers * rank * sum(d_in + d_out for d_in, d_out in [(d, q), (d, kv), (d, kv), (q, d)])


@pytest.fixture(scope="module")
def searched():
    """A budget where no unquantized base fits, even with full remat, and an int8 base with full
    remat does: between the two compiled peaks."""
    config = _tiny_lora()
    full = config.replace("remat.policy=full")
    unquantized = plan(full, "cpu", count_remat_overhead=False).per_device["peak"]
    int8 = full.replace('finetune.quantize={format: int8, targets: ["layers/*"]}')
    quantized = plan(int8, "cpu", count_remat_overhead=False).per_device["peak"]
    assert quantized < unquantized
    return tune(_with_budget(config, (quantized + unquantized) // 2), "cpu"), (quantized + unquantized) // 2


@pytest.mark.slow
def test_tune_picks_the_least_quantized_base_that_fits_and_costs_every_knob(searched):
    result, budget = searched
    assert result.search == "finetune" and result.found and result.budget_bytes == budget
    ft = result.config.finetune
    # nf4 fits too (it stores less), but int8 loses less: the least quantized base that fits wins, at
    # the config's rank, with the remat that makes it fit.
    assert ft.quantize.format == "int8" and ft.lora.rank == 4 and ft.lora.alpha == 8
    assert result.config.remat.policy == "full"
    assert plan(result.config, "cpu").fits
    costs = {(row["knob"], row["value"]): row for row in result.costs}
    assert costs[("quantize", "none")]["own"] and not costs[("quantize", "none")]["fits"]
    # Trainable bytes are exactly rank x (d_in + d_out) per adapted matrix.
    for rank in (2, 4, 8):
        assert costs[("rank", rank)]["trainable_bytes"] == _lora_bytes(rank, 2, 64, 4, 2, 16)
    assert costs[("rank", 8)]["delta_peak_bytes"] > 0 > costs[("rank", 2)]["delta_peak_bytes"]
    frozen = {fmt: costs[("quantize", fmt)]["frozen_bytes"] for fmt in ("none", "int8", "nf4")}
    assert frozen["none"] > frozen["int8"] > frozen["nf4"]
    remat = [costs[("remat", policy)]["delta_peak_bytes"] for policy in ("full", "minimal", "dots")]
    assert remat == sorted(remat) and remat[-1] < 0  # Each keeps less than no remat, full the least.
    # The config's own setting is shown, and why it lost.
    assert any(line.startswith("the config's own setting") and "does not fit" in line
               for line in result.explanation)  # fmt: skip
    assert result.compiles <= 16


def test_cli_tune_on_a_finetune_config_tunes_its_knobs(tmp_path, capsys):
    path = tmp_path / "lora.yaml"
    path.write_text(_tiny_lora().to_yaml())
    # Two compiles: the config's own setting and an int8 base; the rest are skipped, not invented.
    assert main(["tune", str(path), "--target", "cpu", "--max-compiles", "2"]) == 0
    out = capsys.readouterr().out
    assert "shardmem tune --search finetune" in out and "none (config)" in out
    assert "skipped" in out and "2 compiles" in out


def test_tune_finetune_arguments_are_checked():
    with pytest.raises(ConfigError, match="--min-seq-len 4: only --search finetune"):
        tune(_tiny_lora(), "cpu", search="remat", min_seq_len=4)
    with pytest.raises(ConfigError, match="--min-seq-len 100: use a length from 1 to model.seq_len=64"):
        tune(_tiny_lora(), "cpu", min_seq_len=100)
    with pytest.raises(ConfigError, match="--no-offload: only --search remat or layout chooses what to "
                       "offload [(]this is --search finetune"):  # fmt: skip
        tune(_tiny_lora(), "cpu", allow_offload=False)  # Was: ignored, the config's own offload kept.
    plain = load_config(ROOT / "configs" / "tiny.yaml")
    with pytest.raises(ConfigError, match="add a finetune section"):
        tune(plain, "cpu", search="finetune")


STAND_IN = {"vocab_size": 2048, "d_model": 256, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "d_ff": 896,
            "seq_len": 128}  # fmt: skip


def _stand_in(finetune):
    """A Llama with the 8B's proportions scaled down (GQA 4:1, d_ff 3.5 d), batch 1, full remat."""
    return config_from_dict({
        "model": STAND_IN,
        "mesh": {"axes": {"data": 1}}, "remat": {"policy": "full"},
        "precision": {"params": "float32", "compute": "bfloat16"},
        "train": {"global_batch": 1, "steps": 10}, "finetune": finetune,
    })  # fmt: skip


QLORA = {"lora": {"rank": 16, "alpha": 32, "targets": ATTENTION},
         "quantize": {"format": "nf4", "group": 64, "targets": ["layers/w*"]}}  # fmt: skip


def test_full_lora_and_qlora_order_as_the_card_bar_says():
    """On a stand-in: full fine-tuning needs the most, LoRA on a bf16 base less, QLoRA least; adapters
    are the only trainable bytes, exactly."""
    reports = {}
    for name, finetune in [("full", {}), ("lora", {"lora": QLORA["lora"]}), ("qlora", QLORA)]:
        reports[name] = plan(_stand_in(finetune), "cpu", count_remat_overhead=False)
    peak = {name: r.per_device["peak"] for name, r in reports.items()}
    assert peak["full"] > peak["lora"] > peak["qlora"]
    adapters = _lora_bytes(16, 2, 256, 8, 2, 32)
    assert reports["lora"].per_device["params"] == reports["qlora"].per_device["params"] == adapters
    assert reports["full"].per_device["frozen"] == 0
    assert reports["lora"].per_device["frozen"] == 2 * ModelConfig(**STAND_IN).param_count()  # bf16 base
    # NF4: half a byte per weight, a float32 scale per 64 entries of the last axis (or fewer, if shorter).
    matrices = [(256, 8, 32), (256, 2, 32), (256, 2, 32), (8, 32, 256), (256, 896), (256, 896), (896, 256)]
    stored = [math.prod(s) // 2 + math.prod(s) // min(64, s[-1]) * 4 for s in matrices]
    saved = 2 * sum(2 * math.prod(s) - b for s, b in zip(matrices, stored, strict=True))  # Two layers.
    assert reports["qlora"].per_device["frozen"] == reports["lora"].per_device["frozen"] - saved


@pytest.mark.slow
def test_llama3_8b_on_one_rtx_4090():
    """The bar on the real shapes, deviceless: full fine-tuning does not fit; LoRA rank 16 on q/k/v/o
    with a bf16 base and full remat fits (1.0 GiB to spare on JAX 0.10.2); QLoRA fits with 10 GiB."""
    config = load_config(ROOT / "configs" / "llama3-8b-qlora.yaml")
    reports = {
        "full": plan(config.replace("finetune={}"), "rtx-4090", count_remat_overhead=False),
        "lora": plan(config.replace("finetune.quantize=null"), "rtx-4090", count_remat_overhead=False),
        "qlora": plan(config, "rtx-4090", count_remat_overhead=False),
    }
    assert not reports["full"].fits and reports["lora"].fits and reports["qlora"].fits
    adapters = _lora_bytes(16, 32, 4096, 32, 8, 128)
    assert adapters == 54_525_952  # 13,631,488 float32 parameters.
    assert reports["lora"].per_device["params"] == reports["qlora"].per_device["params"] == adapters
    peak = {name: r.per_device["peak"] for name, r in reports.items()}
    assert peak["full"] > peak["lora"] > peak["qlora"]


def test_knobs_list_every_value_the_search_tries_and_each_sets_a_valid_config():
    from shardmem.explore.finetune import knobs

    config = _tiny_lora().replace("train.global_batch=16", "train.micro_batches=2")
    settings = knobs(config, shards=2, min_seq_len=16)
    values = {name: [s.value for s in values] for name, values in settings.items()}
    assert values == {
        "quantize": ["none", "int8", "nf4"],
        "rank": [4, 2, 8],
        "remat": ["none", "dots", "minimal", "full"],
        "micro_batches": [2, 1, 4, 8],  # The config's, one fewer, two more that split over 2 shards.
        "seq_len": [64, 32, 16],
    }
    assert [s.choosable for s in settings["rank"]] == [True, True, False]  # Above the config's: costed only.
    assert all(s.own == (i == 0) for values in settings.values() for i, s in enumerate(values))
    for values in settings.values():
        for s in values[1:]:
            moved = config.replace(*s.overrides)
            assert moved != config
    assert config.replace(*settings["rank"][1].overrides).finetune.lora.alpha == 4  # alpha / rank kept.
    nf4 = config.replace(*settings["quantize"][2].overrides).finetune.quantize
    assert (nf4.format, nf4.group, nf4.targets) == ("nf4", 64, ["layers/*"])
    assert "seq_len" not in knobs(config, shards=2)  # Only where --min-seq-len allows it.
