"""Configuration: defaults, the config files, and one clear error per bad value."""

import dataclasses
import shlex
import typing
from pathlib import Path

import pytest
from conftest import load_config_file

from gyrejax import preflight
from gyrejax.config import MAX_ROW_LENGTHS, Config, ConfigError, from_dict, unknown_field
from gyrejax.trajectory.buckets import MAX_ALLOWED_LENGTHS


def test_defaults_and_tiny_config_build():
    assert isinstance(from_dict({}), Config)
    for cache in ("auto", "off", "", "~/.cache/gyrejax/jax", "relative/cache"):
        assert from_dict({"compilation_cache_dir": cache}).compilation_cache_dir == cache
    config = from_dict(load_config_file("tiny_cpu"))
    assert config.cells.num_cpu_devices == 8 and config.cells.size == 2
    assert config.model.head_dim == 64
    assert from_dict(load_config_file("tiny_cpu", "smoke")).model.num_layers == 1
    learning = from_dict(load_config_file("tiny_cpu", "learning"))  # learning_bench's
    assert learning.harness.task_pool == 0 and learning.eval.every_steps > 0


def test_agent_demo_variant_is_consistent_and_passes_preflight():
    # configs/tiny_cpu.py:agent: the example agent, its task file and the BPE tokenizer
    # (built into the cache on first use) fit together, the model covers the tokenizer.
    config = from_dict(load_config_file("tiny_cpu", "agent"))
    preflight.check(config, config.cells.num_cpu_devices)
    words = shlex.split(config.rl.agent_command)
    assert config.rl.agent == "command" and Path(words[-1]).is_file()
    assert Path(config.rl.tasks_path).is_file()  # absolute: agents run in workspaces
    assert config.rollout.max_seq_len <= config.train.all_row_lengths[-1]
    assert config.harness.context_budget_tokens < config.rollout.max_seq_len


def test_values_are_coerced_to_field_types():
    config = from_dict({"model": {"rope_theta": 10000}, "generate": {"prompts": [[1, 2]]}})
    assert isinstance(config.model.rope_theta, float)
    assert config.generate.prompts == ((1, 2),)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model": {"num_layers": -1}}, r"config\.model\.num_layers=-1: expected a positive"),
        ({"model": {"hidden_size": 0}}, r"config\.model\.hidden_size=0"),
        ({"model": {"num_heads": 4, "num_kv_heads": 3}}, r"config\.model\.num_kv_heads=3"),
        ({"model": {"dtype": "float8"}}, r"config\.model\.dtype='float8': expected one of"),
        ({"model": {"attention": "flash"}}, r"config\.model\.attention='flash'"),
        (
            {"model": {"hiden_size": 3}},
            r"^config: unknown field 'model\.hiden_size'; did you mean 'model\.hidden_size'\?$",
        ),
        ({"modle": {}}, r"^config: unknown field 'modle'; did you mean 'model'\?$"),
        ({"model": {"zzz": 1}}, r"^config: unknown field 'model\.zzz'; known: attention, "),
        ({"seed": -5}, r"^config\.seed=-5: expected an integer >= 0$"),
        ({"model": {"num_layers": "two"}}, r"config\.model\.num_layers='two': expected an integer"),
        ({"model": {"qk_norm": 1}}, r"config\.model\.qk_norm=1: expected true or false"),
        ({"cells": {"size": 3, "fsdp": 3, "num_cpu_devices": 8}}, r"must divide the device count"),
        ({"cells": {"size": 2, "fsdp": 1, "tensor": 1}}, r"config\.cells\.size=2: must equal"),
        (
            {"cells": {"size": 8, "fsdp": 2, "tensor": 1, "sequence": 2}},
            r"^config\.cells\.size=8: must equal cells\.fsdp \* cells\.tensor \* cells\.sequence "
            r"= 2 \* 1 \* 2$",
        ),
        (
            {"cells": {"size": 2, "sequence": 0}},
            r"^config\.cells\.sequence=0: expected a positive integer$",
        ),
        ({"cells": {"sequence": "4"}}, r"^config\.cells\.sequence='4': expected an integer$"),
        ({"rl": {"loss": "dpo"}}, r"config\.rl\.loss='dpo': expected one of ppo, grpo"),
        ({"rl": {"advantage": "gae"}}, r"config\.rl\.advantage='gae'"),
        ({"scheduler": {"policy": "random"}}, r"config\.scheduler\.policy='random'"),
        ({"train": {"learning_rate": -1.0}}, r"config\.train\.learning_rate=-1\.0"),
        ({"generate": {"prompts": [[]]}}, r"config\.generate\.prompts"),
        ({"generate": {"prompts": [[600]]}}, r"token 600 >= model\.vocab_size=512"),
        (
            {"train": {"row_length": 512}},
            r"^config\.rollout\.max_seq_len=2048: must be <= the longest row, "
            r"max\(train\.row_length=512, train\.row_lengths=\(\)\) = 512: a call is trained",
        ),
        (  # a longer bucket, but not long enough
            {"train": {"row_length": 512, "row_lengths": [256, 1024]}},
            r"^config\.rollout\.max_seq_len=2048: must be <= the longest row, "
            r"max\(train\.row_length=512, train\.row_lengths=\(256, 1024\)\) = 1024",
        ),
        (
            {"train": {"row_lengths": [1024, 3000]}},
            r"^config\.train\.row_lengths=\(1024, 3000\): 3000 neither divides nor is a multiple "
            r"of train\.row_length=2048$",
        ),
        (
            {"train": {"row_lengths": [2048]}},
            r"^config\.train\.row_lengths=\(2048,\): repeats a length",
        ),
        ({"train": {"row_lengths": [0]}}, r"^config\.train\.row_lengths=\(0,\): expected a tuple"),
        (
            {"train": {"max_row_shapes": 2}},
            r"^config\.train\.max_row_shapes=2: only with train\.row_lengths$",
        ),
        (
            {"train": {"row_lengths": [1024], "max_row_shapes": -1}},
            r"^config\.train\.max_row_shapes=-1: expected an integer >= 0",
        ),
        (
            {"cells": {"size": 3, "sequence": 3}, "train": {"row_lengths": [4096]}},
            r"^config\.train\.row_lengths=\(4096,\): 4096 is not a multiple of cells\.sequence=3",
        ),
        (
            {"harness": {"context_budget_tokens": 1900}},
            r"config\.rollout\.max_seq_len=2048: must hold harness\.context_budget_tokens",
        ),
        ({"warmup": {"quality": 1.5}}, r"config\.warmup\.quality=1\.5: expected a value in"),
        (  # accepted and ignored would be worse: nothing but the RL loop uses them
            {"rollout": {"vllm_servers": ["http://h:8000"]}, "train": {"steps": 0}},
            r"config\.rollout\.vllm_servers=\('http://h:8000',\): external engines roll out",
        ),
        (
            {
                "rollout": {"engine_servers": ["http://h:8100"]},
                "train": {"steps": 2, "executions_dir": "/s"},
            },
            r"config\.rollout\.engine_servers=.*in the RL loop only",
        ),
        ({"harness": {"task_pool": -1}}, r"config\.harness\.task_pool=-1"),
        (
            {"harness": {"tool_latency_median_s": -1.0}},
            r"config\.harness\.tool_latency_median_s=-1\.0",
        ),
        (
            {"harness": {"tool_latency_sigma": float("inf")}},
            r"config\.harness\.tool_latency_sigma=inf",
        ),
        (
            {"harness": {"sandbox": "docker"}},
            r"config\.harness\.sandbox='docker': expected one of auto, bwrap, python_guard",
        ),
        (
            {"model": {"tokenizer": " "}},
            r"config\.model\.tokenizer=' ': expected 'bytes' or the path of an HF tokenizer",
        ),
        (  # a config file's placeholder left unset
            {"model": {"hf_checkpoint": None}},
            r"^config\.model\.hf_checkpoint=None: required, not set \(pass "
            r"--config\.model\.hf_checkpoint=\.\.\.\)$",
        ),
        (
            {"rollout": {"gpu_memory_utilization": 0}},
            r"config\.rollout\.gpu_memory_utilization=0\.0: expected a fraction in \(0, 1\]",
        ),
        ({"rollout": {"gpu_memory_utilization": 1.5}}, r"gpu_memory_utilization=1\.5"),
        ({"rollout": {"gpu_memory_utilization": True}}, r"gpu_memory_utilization=True"),
        (
            {"train": {"sharding_rules": [["embed", "data"]]}},
            r"config\.train\.sharding_rules.*mesh axis must be one of fsdp, tensor",
        ),
        (
            {"train": {"master_dtype": "bfloat16"}},
            r"^config\.train\.master_dtype='bfloat16': expected one of float32, same$",
        ),
        (
            {"compilation_cache_dir": " /tmp/cache"},
            r"^config\.compilation_cache_dir=' /tmp/cache': expected 'auto', 'off' \(or ''\) "
            r"or a local directory$",
        ),
        ({"compilation_cache_dir": "gs://bucket/cache"}, r"config\.compilation_cache_dir='gs:"),
        ({"compilation_cache_dir": 0}, r"^config\.compilation_cache_dir=0: expected a string$"),
    ],
)
def test_bad_values_name_the_field_and_value(values, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(values)


def test_row_buckets_are_accepted_and_the_menu_cap_is_the_packers():
    config = from_dict({"cells": {"size": 2, "sequence": 2}, "train": {"row_lengths": [512, 4096]}})
    assert config.train.all_row_lengths == (512, 2048, 4096)
    assert MAX_ROW_LENGTHS == MAX_ALLOWED_LENGTHS


def test_contexts_may_be_longer_than_row_length_when_a_bucket_holds_them():
    # The cap is the longest row, not train.row_length: a call longer than L trains in
    # a long bucket.
    config = from_dict(
        {"rollout": {"max_seq_len": 4096}, "train": {"row_length": 1024, "row_lengths": [4096]}}
    )
    assert config.rollout.max_seq_len > config.train.row_length
    assert config.train.all_row_lengths[-1] == config.rollout.max_seq_len


def test_config_is_frozen():
    config = from_dict({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.num_layers = 3


@pytest.mark.parametrize(("name", "variant"), [("tiny_cpu", None), ("qwen3_gpu", "8b")])
def test_config_files_list_every_field_so_every_field_can_be_overridden(name, variant):
    config = load_config_file(name, variant)
    sections = typing.get_type_hints(Config)
    assert set(config.keys()) == set(sections), set(config.keys()) ^ set(sections)
    for name, cls in sections.items():
        if dataclasses.is_dataclass(cls):
            listed, known = set(config[name].keys()), {f.name for f in dataclasses.fields(cls)}
            assert listed == known, (name, known ^ listed)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("model.num_layers", None),
        ("scheduler.max_staleness", None),
        (
            "model.num_layerz",
            "config: unknown field 'model.num_layerz'; did you mean 'model.num_layers'?",
        ),
        ("modl.num_layers", "config: unknown field 'modl'; did you mean 'model'?"),
        (
            "model.num_layers.x",
            "config: unknown field 'model.num_layers.x'; 'model.num_layers' is a value, "
            "not a section",
        ),
    ],
)
def test_unknown_field_paths_are_named_with_the_closest_field(path, message):
    assert unknown_field(path) == message


def test_the_configuration_reference_has_every_field_with_a_meaning_and_is_current():
    """docs/config.md (issue 41): generated from the dataclasses; a field without a
    comment, or a page not regenerated after a change, fails here."""
    from gyrejax import config_docs

    text = config_docs.reference()
    rows = {line.split(" | ")[0]: line.split(" | ") for line in text.splitlines()}
    documented = 0
    for section, cls in config_docs.sections():
        for field in config_docs.fields_of(section, cls):
            name = f"{section}.{field.name}" if section else field.name
            row = rows.get(f"| `{name}`")
            assert row is not None, f"{name}: no entry"
            assert row[2].strip(), f"{name}: no meaning (a comment beside it in config.py)"
            documented += 1
    assert documented > 100
    assert config_docs.DOCS_PAGE.read_text() == text, "stale: python -m gyrejax.config_docs"
