"""[[model]] tables: several models in one config, each with its name, aliases and own parameters;
the single [model] table keeps working as one model."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import attrs
import pytest
import tomli_w

from supervisor import config as configuration
from supervisor.config import Config, locate, modelspec
from supervisor.config.schema import ModelConfig
from supervisor.errors import ConfigError
from supervisor.llama import gguf
from supervisor.models import memory
from tests.rigs.rig import FAKE_GGUF, gguf_header, make_config

SOURCE = "site.toml"


@pytest.fixture
def site(tmp_path: Path) -> dict[str, Any]:
    """Two model files and a binary in tmp_path: a document that passes every check."""
    for name in ("small", "large"):
        (tmp_path / f"{name}.gguf").write_bytes(b"GGUF")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return {
        "decoder": {"binary": str(binary), "threads": 2, "extra_args": ["-fa", "off"]},
        "model": [
            {"path": str(tmp_path / "small.gguf"), "name": "small", "aliases": ["s"], "ctx_size": 2048},
            {"path": str(tmp_path / "large.gguf"), "ctx_size": 4096, "threads": 1, "extra_args": ["--swa-full"]},
        ],
    }


def load(document: dict[str, Any]) -> Config:
    return configuration.loads(tomli_w.dumps(document), SOURCE)


def problems(document: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(document)
    return caught.value.lines


def test_model_tables_are_several_models_and_the_first_is_the_default(site: dict[str, Any]) -> None:
    config = load(site)
    assert len(config.model_tables) == 2
    assert config.model is config.model_tables[0]
    specs = modelspec.specs(config)
    assert [(s.name, s.aliases, s.default, s.preload) for s in specs] == [
        ("small", ("s",), True, True),
        ("large", (), False, False),
    ]


def test_each_model_runs_under_a_one_model_config_of_its_own(site: dict[str, Any]) -> None:
    small, large = modelspec.specs(load(site))
    assert small.config.model_tables == ()
    assert (small.config.model.ctx_size, large.config.model.ctx_size) == (2048, 4096)
    assert (small.config.decoder.threads, large.config.decoder.threads) == (2, 1)
    assert large.config.decoder.extra_args == ("-fa", "off", "--swa-full")
    # llama-server's --alias is the model's name; each model's files under a directory of its own.
    assert large.config.model.alias == "large"
    assert (small.subdir, large.subdir) == ("model-small", "model-large")
    assert large.config.cache.dir.endswith("model-large")


def test_the_single_model_table_is_one_model_with_the_paths_it_always_had(tmp_path: Path) -> None:
    config = Config()
    (only,) = modelspec.specs(config)
    assert (only.default, only.preload, only.subdir) == (True, True, "")
    assert only.config == config


def test_models_default_names_the_default_model_by_name_or_alias(site: dict[str, Any]) -> None:
    config = load({**site, "models": {"default": "large"}})
    assert config.model is config.model_tables[1]
    assert [s.default for s in modelspec.specs(config)] == [False, True]


def test_providers_go_to_the_default_model_unless_a_model_names_them(site: dict[str, Any]) -> None:
    providers = [
        {"kind": "exec", "name": "a", "command": ["/bin/true"]},
        {"kind": "exec", "name": "b", "command": ["/bin/true"]},
    ]
    site["model"][1]["providers"] = ["b"]
    small, large = modelspec.specs(load({**site, "provider": providers}))
    assert [p.name for p in small.config.provider] == ["a"]
    assert [p.name for p in large.config.provider] == ["b"]


def test_a_name_used_twice_is_named_with_both_keys(site: dict[str, Any]) -> None:
    site["model"][1]["aliases"] = ["small"]
    assert problems(site) == ["site.toml: model[1].aliases[0]: 'small' already names model[0]"]


def test_a_default_no_model_has_is_an_error_naming_the_models(site: dict[str, Any]) -> None:
    assert problems({**site, "models": {"default": "huge"}}) == [
        "site.toml: models.default: no model is named 'huge' (models: large, s, small)"
    ]


def test_an_unknown_provider_is_an_error_and_one_named_by_two_models_is_shared(site: dict[str, Any]) -> None:
    site["provider"] = [{"kind": "exec", "name": "a", "command": ["/bin/true"]}]
    site["model"][0]["providers"] = ["a", "nope"]
    site["model"][1]["providers"] = ["a"]
    # A provider two models name runs for one at a time (supervisor/providers/seat.py).
    assert problems(site) == ["site.toml: model[0].providers[1]: no [[provider]] is named 'nope'"]


def test_a_wrong_value_in_a_model_table_is_named_with_its_index(site: dict[str, Any]) -> None:
    site["model"][1]["ctx_size"] = "4k"
    site["model"][0]["ttl_s"] = -1
    site["model"][0]["bogus"] = 1
    lines = problems(site)
    assert sorted(lines) == [
        "site.toml: model[0].bogus: unknown key",
        "site.toml: model[0].ttl_s: must be at least 0, got -1.0",
        'site.toml: model[1].ctx_size: expected int, got "4k"',
    ]


def test_a_missing_model_file_is_named_with_its_index(site: dict[str, Any], tmp_path: Path) -> None:
    site["model"][1]["path"] = str(tmp_path / "gone.gguf")
    assert problems(site) == [f"site.toml: model[1].path: no such file: {tmp_path / 'gone.gguf'}"]


def test_model_tables_round_trip_through_unstructure(site: dict[str, Any]) -> None:
    config = load(site)
    document = configuration.unstructure(config)
    assert isinstance(document["model"], list)
    assert "model_tables" not in document
    assert configuration.structure(document, SOURCE) == config
    tomli_w.dumps(document)  # what `onebitctl config show` prints: no null in it


def test_model_tables_is_no_key_of_the_file(site: dict[str, Any]) -> None:
    assert problems({**site, "model_tables": []}) == ["site.toml: model_tables: unknown key"]


def test_a_reload_adds_and_removes_models_and_applies_their_live_keys(site: dict[str, Any], tmp_path: Path) -> None:
    old = load(site)
    (tmp_path / "third.gguf").write_bytes(b"GGUF")
    changed = {
        **site,
        "model": [
            {**site["model"][0], "ttl_s": 30.0, "ctx_size": 1024},
            {"path": str(tmp_path / "third.gguf"), "name": "third"},
        ],
        "models": {"max_loaded": 1},
    }
    done = configuration.reload(old, load(changed), SOURCE)
    assert done.applied == ("model[small].ttl_s", "model[third]", "model[large]", "models.max_loaded")
    assert done.restart_needed == ("model[small].ctx_size",)
    assert [modelspec.specs(done.config)[i].name for i in range(2)] == ["small", "third"]
    assert done.config.model_tables[0].ttl_s == 30.0
    assert done.config.model_tables[0].ctx_size == 2048  # kept until a restart
    assert done.config.models.max_loaded == 1


def test_a_reload_from_one_model_to_several_needs_a_restart(site: dict[str, Any]) -> None:
    one = {**site, "model": site["model"][0]}
    done = configuration.reload(load(one), load(site), SOURCE)
    assert "model" in done.restart_needed
    assert done.config.model_tables == ()


def test_the_default_directories_are_per_instance_keyed_on_the_port(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert locate.runtime_dir("") == tmp_path / "run" / "onebit"  # 8080: where it always was
    assert locate.runtime_dir("", port=8081) == tmp_path / "run" / "onebit-8081"
    assert locate.prefix_store_dir("", port=8081) == tmp_path / "cache" / "onebit" / "prefix-8081"
    assert locate.runtime_dir("/srv/x", port=8081) == Path("/srv/x")
    # Under systemd each unit has its own directories already.
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/onebit")
    assert locate.runtime_dir("", port=8081) == Path("/run/onebit")


def config_naming(tmp_path_factory: pytest.TempPathFactory, providers: list[list[str] | None]) -> Config:
    runtime = tmp_path_factory.mktemp("seat")
    tables = []
    for index, named in enumerate(providers):
        path = runtime / f"m{index}.gguf"
        path.write_bytes(FAKE_GGUF)
        tables.append({"name": f"m{index}", "path": str(path), **({"providers": named} if named is not None else {})})
    return make_config(
        runtime,
        model=tables,
        provider=[{"kind": "exec", "name": name, "command": ["/bin/true"]} for name in ("p", "q")],
    )


def test_a_provider_is_shared_when_two_model_tables_name_it(tmp_path_factory: pytest.TempPathFactory) -> None:
    assert modelspec.shared_providers(config_naming(tmp_path_factory, [["p"], ["p", "q"], None])) == {"p"}
    # The default model's implicit share is what no other model took: never shared.
    assert modelspec.shared_providers(config_naming(tmp_path_factory, [None, ["p"]])) == frozenset()
    assert modelspec.shared_providers(Config()) == frozenset()


MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("processes", "cache_ram_mib", "mib"),
    [
        (1, 0, 100 + 10),  # the decoder alone, no prompt cache: the file and its KV
        (2, 0, 100 + 2 * 10),  # a llama-server provider: its own KV, the file mapped once
        (2, 1024, 100 + 2 * (10 + 1024)),  # each process's --cache-ram bound
        (1, -1, 100 + 10),  # unbounded: nothing to count
    ],
)
def test_a_models_estimate_counts_the_file_once_and_each_processs_kv_and_prompt_cache(
    processes: int, cache_ram_mib: int, mib: float
) -> None:
    assert memory.footprint_mib(100 * MIB, 10 * MIB, processes=processes, cache_ram_mib=cache_ram_mib) == mib


def test_the_estimate_counts_the_models_llama_server_providers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    runtime = tmp_path_factory.mktemp("estimate")
    base = make_config(runtime, cache={"ram_mib": 0})
    with_provider = make_config(
        runtime, cache={"ram_mib": 0}, provider=[{"kind": "llama-server", "name": "p0", "threads": 1}]
    )
    (alone,), (helped,) = modelspec.specs(base), modelspec.specs(with_provider)
    file_mib = locate_size(alone) / MIB
    kv_mib = memory.estimate_mib(alone, memory.read_model(alone)) - file_mib
    assert kv_mib > 0
    assert memory.estimate_mib(helped, memory.read_model(helped)) == pytest.approx(file_mib + 2 * kv_mib)


def locate_size(spec: modelspec.ModelSpec) -> int:
    path = locate.model_path(spec.table.path)
    assert path is not None
    return path.stat().st_size


def lfm2_header(*, window: int | None = 32) -> bytes:
    """4 layers: 2 of attention (one sliding over ``window``), 2 of short convolution."""
    keys: list[tuple[str, int, Any]] = [
        ("block_count", 4, 4),
        ("embedding_length", 4, 256),
        ("attention.head_count", 4, 2),
        ("attention.head_count_kv", 9, [2, 0, 2, 0]),
        ("shortconv.l_cache", 4, 3),
    ]
    if window is not None:
        keys += [("attention.sliding_window", 4, window), ("attention.sliding_window_pattern", 9, [1, 0, 0, 0])]
    return gguf_header("lfm2", keys)


def lfm2_like(*, window: int | None = 32) -> gguf.Shape:
    return gguf.read_shape(io.BytesIO(lfm2_header(window=window)))


def test_the_caches_are_sized_a_slot_as_llama_cpp_pads_them() -> None:
    """An LFM2-like header (tests/real/test_real_memory.py checks the same sizes against
    llama-server's log): 4096 tokens over 2 slots, 2048 cells a slot in the full-attention layer,
    the 32-token window and a 512-token micro-batch padded to 768 cells a slot in the sliding one
    (all 2048 with --swa-full), no KV in the convolution layers, and a convolution state a slot."""
    shape = lfm2_like()
    table = ModelConfig(ctx_size=4096, parallel=2, ubatch_size=512)
    row = 2 * 128 * 2 * 2  # K and V of 2 heads x 128 in f16
    assert memory.kv_cache_bytes(shape, table, swa_full=False) == row * 2 * (2048 + 768)
    assert memory.kv_cache_bytes(shape, table, swa_full=True) == row * 2 * (2048 + 2048)
    assert memory.recurrent_cache_bytes(shape, table) == 2 * 2 * (3 - 1) * 256 * 4
    assert memory.cache_bytes(shape, table, swa_full=False) == row * 2 * (2048 + 768) + 2 * 2 * 2 * 256 * 4


def test_each_slot_keeps_its_context_checkpoints_of_what_cannot_be_cut_back() -> None:
    """llama-server's checkpoints (tests/real/test_real_memory.py checks one against its log): a
    copy a checkpoint of the sliding layer's window (32 cells a slot, or its 2048 under --swa-full)
    and the convolution state; for the model without a window the state alone, and nothing for a
    sliding window under --swa-full when no recurrent state needs it, nor for a dense model."""
    table = ModelConfig(ctx_size=4096, parallel=2, ubatch_size=512)
    row = 2 * 128 * 2 * 2  # K and V of 2 heads x 128 in f16, one layer
    state = 2 * (3 - 1) * 256 * 4  # one slot's convolution state: 2 layers of l_cache - 1 rows
    assert memory.checkpoint_bytes(lfm2_like(), table, swa_full=False, checkpoints=32) == 2 * 32 * (32 * row + state)
    assert memory.checkpoint_bytes(lfm2_like(), table, swa_full=True, checkpoints=32) == 2 * 32 * (2048 * row + state)
    assert memory.checkpoint_bytes(lfm2_like(window=None), table, swa_full=False, checkpoints=4) == 2 * 4 * state
    gemma_like = attrs.evolve(lfm2_like(), recurrent_layers=0, recurrent_values=0)
    assert memory.checkpoint_bytes(gemma_like, table, swa_full=False, checkpoints=32) == 2 * 32 * 32 * row
    assert memory.checkpoint_bytes(gemma_like, table, swa_full=True, checkpoints=32) == 0
    dense = attrs.evolve(gemma_like, sliding_window=None, swa_layers=0)
    assert memory.checkpoint_bytes(dense, table, swa_full=False, checkpoints=32) == 0


@pytest.mark.parametrize(
    ("args", "checkpoints"),
    [
        ((), memory.CTX_CHECKPOINTS),
        (("-t", "4"), memory.CTX_CHECKPOINTS),
        (("--ctx-checkpoints", "8"), 8),
        (("-ctxcp", "8", "--swa-checkpoints", "0"), 0),  # llama-server takes the last
        (("--ctx-checkpoints",), memory.CTX_CHECKPOINTS),
    ],
)
def test_the_checkpoints_counted_are_those_the_decoders_flags_keep(args: tuple[str, ...], checkpoints: int) -> None:
    assert memory.ctx_checkpoints(args) == checkpoints


def test_the_estimate_counts_a_hybrid_models_checkpoints_as_its_extra_args_set_them(tmp_path: Path) -> None:
    path = tmp_path / "lfm2.gguf"
    path.write_bytes(lfm2_header(window=None))
    model = {"path": str(path), "ctx_size": 4096, "parallel": 2}
    estimated = []
    for extra_args in [[], ["--ctx-checkpoints", "0"]]:
        (spec,) = modelspec.specs(make_config(tmp_path, model={**model, "extra_args": extra_args}))
        estimated.append(memory.estimate_mib(spec, memory.read_model(spec)))
    state_mib = 2 * (3 - 1) * 256 * 4 / MIB  # one slot's convolution state
    taken = estimated[0] - estimated[1]
    assert taken == pytest.approx(2 * memory.CTX_CHECKPOINTS * state_mib)
