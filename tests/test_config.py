import dataclasses
import time
from pathlib import Path

import pytest
import yaml

from shardmem.config import Config, config_from_dict, load_config
from shardmem.errors import ConfigError
from shardmem.models.llama import PRESETS

CONFIGS = sorted(Path(__file__).parent.parent.joinpath("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_round_trips(path):
    config = load_config(path)
    assert isinstance(config, Config)
    assert config_from_dict(config.to_dict()) == config
    config.remat_plan()


def test_shipped_configs_cover_the_issue():
    names = {p.stem for p in CONFIGS}
    assert {"tiny", "gpt2-124m", "llama-1b", "llama-7b", "llama-70b", "llama-70b-pipeline"} <= names


def test_overrides_are_parsed_as_yaml():
    config = load_config(CONFIGS[0], ["remat.policy=full", "train.global_batch=32", "model.n_layers=2"])
    assert config.remat.policy == "full"
    assert config.train.global_batch == 32
    assert config.model.n_layers == 2


def test_preset_fields_can_be_overridden():
    config = config_from_dict({"model": {"preset": "llama-7b", "n_layers": 8}})
    assert config.model.n_layers == 8
    assert config.model.d_model == PRESETS["llama-7b"].d_model


def test_replacing_the_preset_replaces_the_model():
    config = load_config(CONFIGS[0])
    other = config.replace("model.preset=gpt2-124m", "model.n_layers=2")
    assert other.model == dataclasses.replace(PRESETS["gpt2-124m"], n_layers=2)
    assert config.replace("model.n_layers=2").model.d_model == config.model.d_model


def test_a_preset_override_replaces_the_model_section_alike_everywhere(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text("model: {preset: tiny, seq_len: 128}\n")
    assert load_config(path).model.seq_len == 128  # In the file, keys beside the preset override it.
    # The same overrides from the command line and through replace() (sweep, tune): the same model.
    overrides = ("model.n_layers=2", "model.preset=gpt2-124m")
    expected = dataclasses.replace(PRESETS["gpt2-124m"], n_layers=2)
    assert load_config(path, overrides).model == load_config(path).replace(*overrides).model == expected


def test_reserve_accepts_units():
    config = config_from_dict({"model": {"preset": "tiny"}, "memory": {"reserve": "512MiB"}})
    assert config.memory.reserve == 512 * 2**20
    assert (
        config_from_dict({"model": {"preset": "tiny"}, "memory": {"reserve": "2PiB"}}).memory.reserve == 2**51
    )
    # Issue 20, item 14: "cannot read '99999999999PiB' as a byte size" hid that it is only too large.
    with pytest.raises(
        ConfigError, match=r"memory.reserve: '99999999999PiB' is too large: 1.13e\+26 bytes, over"
    ):
        config_from_dict({"model": {"preset": "tiny"}, "memory": {"reserve": "99999999999PiB"}})


@pytest.mark.parametrize(
    "raw, fragments",
    [
        ({"model": {"preset": "tiny"}, "remat": {"polcy": "full"}}, ["remat.polcy", "did you mean 'policy'"]),
        ({"model": {"preset": "llama-8b"}}, ["model.preset='llama-8b'", "llama-7b"]),
        (
            {"model": {"preset": "tiny"}, "train": {"global_batch": "many"}},
            ["train.global_batch", "whole number"],
        ),
        (
            {"model": {"preset": "tiny"}, "serve": {"batch": "8"}},
            ["serve.batch='8'", "without quotes (serve.batch: 8)"],
        ),
        (
            {"model": {"preset": "tiny"}, "serve": {"max_len": "1e4"}},
            ["serve.max_len='1e4'", "(serve.max_len: 10000)"],
        ),
        (
            {"model": {"preset": "tiny"}, "serve": {"batch": -1}},
            ["serve.batch=-1: must be positive; give a value"],
        ),
        (
            {"model": {"preset": "tiny"}, "finetune": None},
            ["finetune is empty", "write finetune: {} for the"],
        ),
        (
            {"model": {"preset": "tiny"}, "train": {"global_batch": 10, "micro_batches": 4}},
            ["train.micro_batches=4", "divisor of 10"],
        ),
        ({"model": {"preset": "tiny"}, "mesh": {"axes": {"data": -1, "fsdp": -1}}}, ["at most one axis"]),
        ({"model": {"preset": "tiny", "n_kv_heads": 3}}, ["model.n_kv_heads=3", "model.n_heads=4"]),
        ({"model": {"preset": "tiny"}, "remat": {"policy": "fulll"}}, ["remat.policy='fulll'", "full"]),
        (
            {"model": {"preset": "tiny"}, "finetune": {"quantize": {"format": "NF4"}}},
            ["finetune.quantize.format='NF4' (did you mean 'nf4'?)"],
        ),
        ({"model": {"preset": "tiny"}, "remat": {"layers": {"2-9": "full"}}}, ["remat.layers.2-9", "0 to 3"]),
        ({"model": {"preset": "tiny"}, "remat": {"layers": {"0-2": "full", "2": "none"}}}, ["already"]),
        (
            {"model": {"preset": "tiny"}, "remat": {"policy": "custom", "custom": {"qkv": "save"}}},
            ["remat.custom.qkv", "query_proj"],
        ),
        ({"model": {"preset": "tiny"}, "memory": {"target": "h100"}}, ["memory.target='h100'", "h100-sxm"]),
        ({"model": {"preset": "tiny"}, "memory": {"reserve": "lots"}}, ["memory.reserve", "1GiB"]),
        ({"model": {"preset": "tiny"}, "precision": {"compute": "fp8"}}, ["precision.compute", "bfloat16"]),
        ({"model": {}}, ["model.vocab_size is required", "model.preset"]),
        (  # The model section left to a checkpoint that is not there: the path is the mistake.
            {"model": {"seq_len": 64}, "finetune": {"init_from": "/no/such/Llama-3.2-1B"}},
            ["finetune.init_from='/no/such/Llama-3.2-1B': no such file or folder", "model.vocab_size"],
        ),
        ({"model": {"preset": "tiny", "head_dim": -4}}, ["model.head_dim=-4", "positive"]),
        ({"model": {"preset": "tiny"}, "optimizer": {"b2": 1.5}}, ["optimizer.b2=1.5", "[0, 1)"]),
        ({"model": {"preset": "tiny"}, "optimizer": {"warmup_steps": -1}}, ["optimizer.warmup_steps=-1"]),
        (
            {"model": {"preset": "tiny"}, "optimizer": {"learning_rate": float("nan")}},
            ["optimizer.learning_rate=nan", "finite"],
        ),
        ({"model": {"preset": "tiny", "rope_theta": float("inf")}}, ["model.rope_theta=inf", "finite"]),
        ({"model": {"preset": "tiny"}, "memory": {"reserve": float("inf")}}, ["memory.reserve", "finite"]),
        ({"model": {"preset": "tiny"}, "train": {"seed": -1}}, ["train.seed=-1", "non-negative"]),
        ({"model": {"preset": "tiny"}, "remat": {"layers": {"3-1": "full"}}}, ["remat.layers.3-1", '"1-3"']),
        (
            {"model": {"preset": "tiny"}, "remat": {"custom": {"qeury_proj": "save"}}},
            ["remat.custom.qeury_proj", "query_proj"],
        ),
        (
            {"model": {"preset": "tiny"}, "name": "../../etc/evil"},
            ["name='../../etc/evil'", "name: etc-evil"],
        ),
        ({"model": {"preset": "tiny"}, "name": ""}, ["name=''", "runs/<name>", "name: my-run"]),
        ({"model": {"preset": "tiny"}, "name": ".."}, ["name='..'", "one folder name"]),
    ],
)
def test_config_errors_name_the_key_and_the_fix(raw, fragments):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    "given, says",
    [
        ("adapters", "is PEFT's adapters (adapter_config.json), not a model; give the base model's folder"),
        ("adapters/adapter_model.safetensors", "is PEFT's adapters (adapter_config.json), not a model"),
        ("base/config.json", "is a file, not weights; give the folder it is in"),
        ("weights", "has no config.json to give model.vocab_size, which the model section leaves out"),
    ],
)
def test_a_model_section_left_to_an_init_from_that_has_no_config_json_names_what_it_is(
    tmp_path, monkeypatch, given, says
):
    """It said "model.vocab_size is required; or point finetune.init_from at a Hugging Face folder", for a
    path that is one: the mistake is which path."""
    folders = {"adapters": ["adapter_config.json", "adapter_model.safetensors"],
               "base": ["config.json", "model.safetensors"], "weights": ["model.safetensors"]}  # fmt: skip
    for folder, files in folders.items():
        (tmp_path / folder).mkdir()
        for name in files:
            (tmp_path / folder / name).write_text("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": {"seq_len": 64}, "finetune": {"init_from": given}})
    assert str(info.value).startswith(f"finetune.init_from={given!r}") and says in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(CONFIGS[0], ["remat.policy"])
    with pytest.raises(ConfigError, match="train.steps is a value, not a section; write --set train.steps="):
        load_config(CONFIGS[0], ["train.steps.x=1"])
    # It blamed remat.layers (tiny's per-layer plan needs the depth of a model of your own).
    with pytest.raises(
        ConfigError, match=r"^model is empty: give model.preset \(tiny, .*: \{preset: tiny\}$"
    ):
        load_config("configs/tiny.yaml", ["model=null"])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    # One line, not PyYAML's eight that quote the text twice (issue 30): where, what, within what.
    bad.write_text("name: x\nmodel: {preset: tiny\nmesh:\n  axes: {data: 2}\n")
    with pytest.raises(ConfigError) as error:
        load_config(bad)
    assert str(error.value) == (f"{bad}, line 3, column 5: not valid YAML: expected ',' or '}}', but got ':' "
                                "(while parsing a flow mapping from line 2)")  # fmt: skip


def test_a_file_needs_a_model_section_and_python_may_bring_the_model(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("mesh: {axes: {data: 2}}\n")
    with pytest.raises(ConfigError, match="no model section; add e.g. model: {preset: tiny}"):
        load_config(path)
    assert config_from_dict({"mesh": {"axes": {"data": 2}}}).model is None  # model_factory= comes later


@pytest.mark.parametrize("section, value, example", [
    ("serve.quantize", "nf4", ", e.g. serve.quantize={format: nf4}"),  # The one key that takes a word.
    ("optimizer", "adamw", ", e.g. optimizer={name: adamw}"),
    ("train", 5, ""),  # A number that many keys take: no guess at which.
])  # fmt: skip
def test_a_section_given_a_value_says_the_key_that_takes_it(section, value, example):
    data = {"model": {"preset": "tiny"}}
    parent, _, leaf = section.rpartition(".")
    (data.setdefault(parent, {}) if parent else data)[leaf] = value
    with pytest.raises(ConfigError) as error:
        config_from_dict(data)
    assert str(error.value).startswith(f"{section}={value!r}: expected a mapping with keys ")
    assert str(error.value).endswith(example if example else " or loss"), str(error.value)


def _bomb(levels: int) -> str:
    """A "billion laughs": each level an alias list of nine of the previous one (9**levels values)."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(["model: {preset: tiny}", *lines]) + "\n"


@pytest.mark.parametrize(
    "content, message",
    [
        (_bomb(9).encode(), r"aliases \(\*name\) expand to more than 100,000 values \(from line \d+\)"),
        (
            b"model: {preset: tiny}\nx: &a [1, *a]\n",
            "alias at line 2 refers to a collection that contains it",
        ),
        (b"model: {preset: tiny}\nx: " + b"[" * 5000 + b"]" * 5000, "nested deeper than 64 levels"),
        (b"model: {preset: tiny}\nx: " + b"[" * 100 + b"]" * 100, r"nested deeper than 64 levels \(line 2\)"),
        (
            "name: caf\u00e9\nmodel: {preset: tiny}\n".encode("latin-1"),
            r"not UTF-8 text \(byte 0xe9 at offset 9\)",
        ),
        (b"model: {preset: tiny}\n" + b"# padding\n" * 120_000, "is over 1 MiB"),
    ],
    ids=["alias bomb", "recursive alias", "5000 deep", "100 deep", "latin-1", "1.2 MB"],
)
def test_hostile_config_files_are_config_errors_found_fast(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    # Before the limits these took minutes and gigabytes; the bound leaves room for a loaded machine.
    assert time.perf_counter() - started < 30, "rejected, but too slowly"


def test_aliases_within_the_limits_still_load(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("model: {preset: tiny}\nrules: {heads: &t tensor, mlp: *t}\n")
    assert load_config(path).to_dict()["rules"]["mlp"] == "tensor"


def test_a_key_given_twice_is_an_error_naming_it_and_both_lines(tmp_path):
    # Issue 20, item 10: YAML kept the second `model` and dropped the first without a word.
    path = tmp_path / "twice.yaml"
    path.write_text("name: x\nmodel: {preset: tiny}\nmodel: {preset: gpt2-124m}\n")
    with pytest.raises(ConfigError, match=r"key 'model' is given twice, at lines 2 and 3"):
        load_config(path)
    path.write_text("model: {preset: tiny}\nmesh:\n  axes: {data: 2,\n    data: 4}\n")
    with pytest.raises(ConfigError, match=r"key 'mesh.axes.data' is given twice, at lines 3 and 4"):
        load_config(path)
    # A merge key may be overridden after it (that is what it is for), and an alias is no repeat.
    path.write_text(
        "model: {preset: tiny}\nrules:\n  <<: &b {embed: fsdp, heads: fsdp}\n  heads: tensor\n"
        "param_rules: {x: [*b, *b]}\n"
    )
    config = load_config(path)
    assert config.rules == {"embed": "fsdp", "heads": "tensor"} and len(config.param_rules["x"]) == 2


def test_a_window_on_some_layers_round_trips_through_yaml_and_its_mistakes_name_the_key():
    config = config_from_dict({"model": {"preset": "tiny", "sliding_window": 8, "sliding_layers": [0, 2]}})
    assert config.model.sliding_layers == (0, 2)  # A tuple: the model's config is hashed.
    again = config_from_dict(yaml.safe_load(config.to_yaml()))
    assert again == config
    for layers, words in (
        ([0, 4], "model.sliding_layers: 4 is not a layer of the model's 4 (0 to 3)"),
        ([1, 1], "a layer is listed twice"),
        (["a"], "model.sliding_layers[0]='a'"),
    ):
        with pytest.raises(
            ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
        ):
            config_from_dict({"model": {"preset": "tiny", "sliding_window": 8, "sliding_layers": layers}})
    assert config_from_dict({}).replace("train.steps=3").model is None  # No model section: a factory's.
    every = config.replace("model.sliding_layers=[0, 1, 2, 3]").model  # Every layer: the window applies.
    assert every.layer_window == 8 and not every.windows_vary and config.model.windows_vary
    assert config.replace("model.sliding_layers=[]").model.layer_window is None  # None: no window.
    with pytest.raises(ConfigError, match="model.sliding_layers=.0. without model.sliding_window"):
        config_from_dict({"model": {"preset": "tiny", "sliding_layers": [0]}})
    with pytest.raises(ConfigError, match="model.attention_softcap=0.0: must be positive"):
        config_from_dict({"model": {"preset": "tiny", "attention_softcap": 0}})
