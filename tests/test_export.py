"""shardmem export (shardmem.finetune.export): folders transformers and PEFT load as they are, written whole
or not at all, never over an earlier export without --force nor over the run's own init_from."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

pytest.importorskip("safetensors")
import hf_reference as hf  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from shardmem import ConfigError, build_mesh, build_program, config_from_dict  # noqa: E402
from shardmem.cli import main  # noqa: E402
from shardmem.finetune import export as exporting  # noqa: E402
from shardmem.finetune import weight  # noqa: E402
from shardmem.run.checkpoint import Checkpointer  # noqa: E402

LORA = {"rank": 2, "alpha": 6, "targets": ["layers/wq", "embedding", "lm_head"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A LoRA run of 3 steps' worth (its adapters' B made non-zero) from a Hugging Face folder with its
    config.json and a tokenizer file: ``(config file, run folder, base folder, program, state)``."""
    root = tmp_path_factory.mktemp("export")
    base = root / "base"
    hf.save(base, hf.hf_config("llama"), hf.random_tensors(hf.hf_config("llama"), seed=8))
    (base / "tokenizer.json").write_text('{"version": "1.0"}')
    raw = {"name": "lora", "model": {"seq_len": 16}, "mesh": {"axes": {"fsdp": -1}},
           "precision": {"compute": "float32"}, "train": {"global_batch": 8},
           "finetune": {"init_from": str(base), "base_dtype": "float32", "lora": LORA}}  # fmt: skip
    config_file = root / "lora.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    config = config_from_dict(raw)
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    state = program.init()
    for adapters in (
        state["params"]["layers"]["wq"],
        state["params"]["embedding"],
        state["params"]["lm_head"],
    ):
        b = adapters["lora_b"]
        adapters["lora_b"] = jax.device_put(0.05 * jax.random.normal(jax.random.key(3), b.shape), b.sharding)
    (root / "run").mkdir()
    (root / "run" / "config.yaml").write_text(config.to_yaml())
    with Checkpointer(root / "run" / "checkpoints", every=1, keep=1) as checkpointer:
        checkpointer.save(3, state, force=True)
    return config_file, root / "run", base, program, state


def _export(run, out, *extra):
    config_file, run_dir = run[:2]
    return main(["export", str(config_file), "--run-dir", str(run_dir), "--out", str(out), *extra])


def _one_line(capsys, *words):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardmem: error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


def _merged(program, state) -> dict:
    """The run's merged weights by shardmem's own assembly, float32."""
    full = program.finetune.assemble(state["params"], state["frozen"])
    return jax.tree.map(
        lambda v: np.asarray(weight(v, jnp.float32)), full, is_leaf=lambda x: not isinstance(x, dict)
    )


def test_a_merged_export_is_a_folder_transformers_loads_with_the_runs_logits(run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers", "4", reason="needs transformers<5 (its Flax Llama)")
    if not hasattr(transformers, "FlaxLlamaForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models")
    _, _, base, program, state = run
    assert _export(run, tmp_path / "out", "--dtype", "float32") == 0
    assert "wrote the weights (LoRA merged) of step 3 to" in capsys.readouterr().err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["model_type"] == "llama"
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (base / "tokenizer.json").read_text()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = transformers.FlaxLlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=jnp.float32)
    tokens = np.random.default_rng(0).integers(0, hf.V, (2, 16), dtype=np.int32)
    merged = _merged(program, state)
    written = {"model.embed_tokens.weight": merged["embedding"], "lm_head.weight": merged["lm_head"].T,
               "model.norm.weight": merged["final_norm"]["scale"]}  # fmt: skip
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, value in written.items():
        np.testing.assert_allclose(got[name], value, atol=1e-6)
    expected = hf.logits(hf.hf_config("llama"), got, tokens)  # transformers' forward of the merged weights.
    np.testing.assert_allclose(np.asarray(model(tokens).logits), expected, atol=1e-4, rtol=1e-4)


def test_adapters_of_a_base_that_is_a_shardmem_run_warn_that_they_name_no_base(
    run, tmp_path, capsys, monkeypatch
):
    written = tmp_path / "adapters" / "adapter_config.json"

    def export_run(config, run_dir, out, **kwargs):  # What an export of a run on a shardmem base writes.
        written.parent.mkdir()
        written.write_text(json.dumps({"base_model_name_or_path": None}))
        return 3, [written.parent / "adapter_model.safetensors", written]

    monkeypatch.setattr(exporting, "export_run", export_run)
    assert _export(run, written.parent, "--adapters-only") == 0
    err = capsys.readouterr().err
    assert "names no base model (base_model_name_or_path: null)" in err and "PEFT" in err, err


@pytest.mark.newest
def test_adapters_only_writes_peft_names_and_its_config(run, tmp_path, capsys):
    _, _, base, program, state = run
    assert _export(run, tmp_path / "adapters", "--adapters-only", "--dtype", "float32") == 0
    peft = load_file(str(tmp_path / "adapters" / "adapter_model.safetensors"))
    prefix = "base_model.model."
    assert peft[prefix + "model.embed_tokens.lora_embedding_A"].shape == (2, hf.V)  # [r, vocab]
    assert peft[prefix + "model.embed_tokens.lora_embedding_B"].shape == (hf.D, 2)  # [d_model, r]
    assert peft[prefix + "lm_head.lora_A.weight"].shape == (2, hf.D)
    assert peft[prefix + "model.layers.1.self_attn.q_proj.lora_B.weight"].shape == (hf.H * hf.K, 2)
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base) and config["inference_mode"] is True
    assert "warning" not in capsys.readouterr().err  # A Hugging Face base: PEFT loads the adapters onto it.
    assert config["target_modules"] == ["embed_tokens", "lm_head", "q_proj"] and config["lora_alpha"] == 6
    # PEFT's merge (W + alpha / r x B A; an embedding's transposed) gives the run's merged weights.
    tensors = load_file(str(base / "model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    merged = _merged(program, state)
    a, b = (
        peft[prefix + "model.embed_tokens.lora_embedding_A"],
        peft[prefix + "model.embed_tokens.lora_embedding_B"],
    )
    np.testing.assert_allclose(tensors["model.embed_tokens.weight"] + scale * (b @ a).T, merged["embedding"],
                               atol=1e-6)  # fmt: skip
    a, b = peft[prefix + "lm_head.lora_A.weight"], peft[prefix + "lm_head.lora_B.weight"]
    np.testing.assert_allclose(tensors["lm_head.weight"] + scale * b @ a, merged["lm_head"].T, atol=1e-6)


def test_an_export_is_replaced_only_with_force_and_never_over_init_from(run, tmp_path, capsys):
    base = run[2]
    assert _export(run, tmp_path) == 0
    first = (tmp_path / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert _export(run, tmp_path, "--dtype", "float32") == 2
    _one_line(capsys, "already holds model.safetensors, config.json", "pass --force to replace them")
    assert (tmp_path / "model.safetensors").read_bytes() == first
    assert _export(run, tmp_path, "--dtype", "float32", "--force") == 0
    assert len((tmp_path / "model.safetensors").read_bytes()) > len(first)  # float32 now.
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    capsys.readouterr()
    assert _export(run, base, "--force") == 2  # The fp32 base replaced by bf16 merged weights: never.
    _one_line(capsys, "holds finetune.init_from, the weights this run started from")
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before


@pytest.mark.newest
def test_ctrl_c_mid_write_exits_130_and_leaves_the_earlier_export(run, tmp_path, capsys, monkeypatch):
    assert _export(run, tmp_path) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    write = exporting._write

    def interrupted(file, header, tensors):
        write(file, header, tensors[:3])  # Part of the file, then Ctrl-C.
        raise KeyboardInterrupt

    monkeypatch.setattr(exporting, "_write", interrupted)
    capsys.readouterr()
    assert _export(run, tmp_path, "--force") == 130
    assert capsys.readouterr().err == "shardmem: interrupted\n"
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # No partial file, none replaced.


def test_a_full_disk_writes_nothing(run, small_disk, capsys):
    disk = small_disk("64k")  # The bfloat16 export is about 110 KB.
    assert _export(run, disk / "out") == 2
    _one_line(capsys, "the export needs", "free; free space or choose another place")
    assert list((disk / "out").iterdir()) == []


@pytest.mark.parametrize("out, says", [
    ("/proc/shardmem-export", "cannot create the folder there"),
    ("{file}", "is a file, not a folder"),
    ("{file}/under", "a part of the path is a file, not a folder"),
])  # fmt: skip
def test_an_out_that_cannot_be_a_folder_is_one_line(run, tmp_path, capsys, out, says):
    (tmp_path / "file").write_text("mine")
    assert _export(run, out.format(file=tmp_path / "file")) == 2
    _one_line(capsys, says)
    assert (tmp_path / "file").read_text() == "mine"


@pytest.mark.parametrize("inside", ["checkpoints", "checkpoints/3", "checkpoints/3/default"])
def test_a_runs_checkpoints_or_step_folder_as_run_dir_names_the_run_folder(run, capsys, inside):
    config_file, run_dir = run[:2]
    argv = ["export", str(config_file), "--run-dir", str(run_dir / inside), "--out", "/nonexistent"]
    assert main(argv) == 2  # It said "no checkpoint to export; train first".
    if inside == "checkpoints":
        _one_line(capsys, "is a run's checkpoints folder; give the run's own folder", f"--run-dir {run_dir})")
    else:
        _one_line(capsys, "is step 3's checkpoint folder of a run", f"(--run-dir {run_dir} --step 3)")


def test_a_run_dir_that_is_not_a_run_says_what_it_is(run, tmp_path, capsys):
    """Each said "has no checkpoint to export; train first"; a run's config.yaml, "a checkpoints folder"."""
    config_file, run_dir = run[:2]
    for name in ("a", "lora"):  # Runs train wrote, one of them under the config's name.
        (tmp_path / "runs" / name / "checkpoints").mkdir(parents=True)
        (tmp_path / "runs" / name / "config.yaml").write_text("name: x\n")
    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / "model.safetensors").write_bytes(b"")
    for given, says in [
        (
            tmp_path / "runs",
            f"holds runs (a, lora), not one; give the one to export (--run-dir {tmp_path}/runs/lora)",
        ),
        (exported, "holds safetensors weights (a Hugging Face checkpoint or an export), not a shardmem run"),
        (
            run_dir / "config.yaml",
            f"is inside the run {run_dir}; give the run's own folder (--run-dir {run_dir})",
        ),
    ]:
        argv = ["export", str(config_file), "--run-dir", str(given), "--out", str(tmp_path / "out")]
        assert main(argv) == 2
        _one_line(capsys, f"--run-dir {str(given)!r} {says}")


@pytest.mark.parametrize("inside", [".", "checkpoints", "checkpoints/3"])
def test_an_out_that_is_the_run_or_its_checkpoints_is_refused(run, capsys, inside):
    """The export's safetensors there made the run read as them (finetune.init_from, generate), not as
    its newest checkpoint."""
    run_dir = run[1]
    before = sorted(p.name for p in run_dir.rglob("*"))
    assert _export(run, run_dir / inside) == 2
    _one_line(capsys, "is the run's folder or holds its checkpoints", f"--out exported/{run_dir.name}")
    assert sorted(p.name for p in run_dir.rglob("*")) == before
    if inside == ".":  # A folder of its own in the run is fine.
        import shutil

        assert _export(run, run_dir / "exported", "--dtype", "float32") == 0
        shutil.rmtree(run_dir / "exported")  # The module's run as it was.


def test_step_exports_that_checkpoint_and_a_step_not_saved_lists_those_there(run, tmp_path, capsys):
    """Only the newest checkpoint could be exported: the fix a diverged run's export suggested, an earlier
    checkpoint, had no flag, and a step's folder as --run-dir said there was no checkpoint."""
    config_file, run_dir, _, program, state = run
    with Checkpointer(run_dir / "checkpoints", every=1, keep=5) as checkpointer:
        later = jax.tree.map(lambda x: x, state)
        b = later["params"]["layers"]["wq"]["lora_b"]
        later["params"]["layers"]["wq"]["lora_b"] = jax.device_put(b + 1.0, b.sharding)
        checkpointer.save(4, later, force=True)
    try:
        assert _export(run, tmp_path / "newest", "--dtype", "float32") == 0
        assert _export(run, tmp_path / "three", "--dtype", "float32", "--step", "3") == 0
        assert "of step 3 to" in capsys.readouterr().err
        newest, three = (load_file(str(tmp_path / f / "model.safetensors")) for f in ("newest", "three"))
        name, wq_DxHxK = "model.layers.1.self_attn.q_proj.weight", _merged(program, state)["layers"]["wq"][1]
        np.testing.assert_allclose(three[name], wq_DxHxK.reshape(wq_DxHxK.shape[0], -1).T, atol=1e-6)
        assert np.abs(newest[name] - three[name]).max() > 0.1  # Step 4 is another model.
        assert _export(run, tmp_path / "five", "--step", "5") == 2
        _one_line(capsys, f"--step 5: {run_dir} has no checkpoint of that step; it has steps 3, 4")
    finally:
        import shutil

        shutil.rmtree(run_dir / "checkpoints" / "4")  # The module's run as it was.


def test_a_newest_checkpoint_that_does_not_restore_is_said_not_passed_over_silently(run, tmp_path, capsys):
    """The export moved it aside (renamed in the run's folder) and wrote the step before, with no word."""
    import shutil

    run_dir, state = run[1], run[4]
    with Checkpointer(run_dir / "checkpoints", every=1, keep=5) as checkpointer:
        checkpointer.save(4, state, force=True)
    (run_dir / "checkpoints" / "4" / "default" / "_METADATA").write_text("garbage")
    try:
        assert _export(run, tmp_path / "out") == 0
        err = capsys.readouterr().err
        assert err.startswith("warning: checkpoint 4 does not restore (") and "; exporting step 3\n" in err
        assert "wrote the weights (LoRA merged) of step 3 to" in err
    finally:
        for moved in (run_dir / "checkpoints").glob("4*"):
            shutil.rmtree(moved)  # The module's run as it was.


def test_export_merges_with_the_runs_own_settings(run, capsys):
    assert _export(run, "/nonexistent", "--set", "finetune.lora.alpha=1") == 2
    _one_line(
        capsys, "finetune.lora.alpha=1.0 here but 6.0 in the run", "export with the config the run trained"
    )


def test_export_refuses_another_base_than_the_runs_but_takes_its_own_by_another_path(
    run, tmp_path, capsys, monkeypatch
):
    """init_from was not compared: another checkpoint of the same shapes gave the export its config.json and
    tokenizer, and an adapter export PEFT's base_model_name_or_path, the adapters not trained on it."""
    import shutil

    base = run[2]
    shutil.copytree(base, tmp_path / "instruct")
    assert _export(run, tmp_path / "out", "--set", f"finetune.init_from={tmp_path / 'instruct'}") == 2
    _one_line(capsys, f"finetune.init_from={tmp_path / 'instruct'} here but {base} in the run",
              "its base's config.json and tokenizer files go beside them")  # fmt: skip
    assert not (tmp_path / "out").exists()
    assert _export(run, "/nonexistent", "--set", "finetune.quantize={format: int8, group: 32}") == 2
    _one_line(capsys, "finetune.quantize={format: int8, group: 32, targets: ['*']} here but null in the run")
    monkeypatch.chdir(base.parent)  # The run's own base, named relative to the working directory.
    assert _export(run, tmp_path / "same", "--set", f"finetune.init_from={base.name}") == 0
    assert (tmp_path / "same" / "model.safetensors").is_file()


def test_float16_refuses_entries_beyond_its_range(run, tmp_path):
    _, _, _, program, state = run
    state = dict(state, frozen=jax.tree.map(lambda x: x, state["frozen"]))
    norm = state["frozen"]["final_norm"]["scale"]
    state["frozen"]["final_norm"]["scale"] = jax.device_put(norm.at[3].set(1e5), norm.sharding)
    with pytest.raises(ConfigError) as error:
        exporting.export_safetensors(program, state, tmp_path, dtype=jnp.float16)
    message = str(error.value)
    assert message.startswith(
        "export --dtype float16: model.norm.weight has an entry of 100000, beyond float16's"
    )
    assert "export with --dtype bfloat16 or float32" in message and list(tmp_path.iterdir()) == []


def test_adapters_only_refuses_what_peft_files_cannot_hold(run, tmp_path):
    config = run[3].config
    for change, says in [
        ("finetune.freeze=[layers/*, embedding]", "the run also trains final_norm/scale \\(not adapters\\)"),
        ("model.tie_embeddings=true", "the embedding's adapter also changes the output head here"),
    ]:
        if "tie" in change:  # No lm_head to adapt, and a checkpoint without config.json to disagree with.
            changed = config.replace("finetune.init_from=null", change, "finetune.lora.targets=[embedding]")
        else:
            changed = config.replace(change)
        program = build_program(changed, build_mesh(changed.mesh.axes, jax.devices()))
        with pytest.raises(ConfigError, match=says):
            exporting.export_safetensors(program, None, tmp_path, adapters_only=True)
    assert list(tmp_path.iterdir()) == []


def test_the_export_command_prints_one_line_without_the_cuda_noise(run, tmp_path):
    config_file, run_dir = run[:2]
    done = subprocess.run([sys.executable, "-m", "shardmem", "export", str(config_file), "--run-dir",
                           str(run_dir), "--out", str(tmp_path), "--adapters-only"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    file = tmp_path / "adapter_model.safetensors"
    assert done.stderr == f"wrote the adapters of step 3 to {file}, with adapter_config.json\n"
