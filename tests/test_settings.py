"""Settings precedence (flags > env > config file > defaults), sources and bad input."""

import pytest

from mlxkv.engine.settings import FIELDS, Settings, SettingsError, parse_bytes


def test_defaults_and_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    s = Settings.load({}, env={})
    # the demo model recommends greedy decoding in its generation_config.json
    assert s.temperature == 0.0 and s.sources["temperature"].startswith("model ")
    assert all(src == "default" for n, _, src in s.describe() if n != "temperature")
    assert [n for n, _, _ in s.describe()] == [f.name for f in FIELDS]
    assert s.block_tokens == 256 and s.dtype == "auto" and s.blas == "auto"
    assert s.model.endswith("engine/demo/model")


def test_precedence_flag_env_file_default(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('max_tokens = 11\ntemperature = 0.1\ntop_k = 5\nmodel = "from-file"\n')
    env = {"MLXKV_MAX_TOKENS": "22", "MLXKV_TEMPERATURE": "0.2"}
    s = Settings.load({"max_tokens": 33, "top_p": None}, env=env, config_path=cfg)
    assert (s.max_tokens, s.sources["max_tokens"]) == (33, "flag --max-tokens")
    assert (s.temperature, s.sources["temperature"]) == (0.2, "env MLXKV_TEMPERATURE")
    assert (s.top_k, s.sources["top_k"]) == (5, f"config {cfg}")
    assert s.model == "from-file"
    assert (s.top_p, s.sources["top_p"]) == (1.0, "default")  # None flag = not given


def test_config_file_from_env_and_mlxkv_table(tmp_path):
    cfg = tmp_path / "other.toml"
    cfg.write_text('[mlxkv]\nram_cache_bytes = "1GiB"\nprefix_cache = false\n')
    s = Settings.load({}, env={"MLXKV_CONFIG": str(cfg)})
    assert s.ram_cache_bytes == 1024**3 and s.prefix_cache is False
    assert s.config_path == cfg


@pytest.mark.parametrize("env, needle", [
    ({"MLXKV_MAX_TOKENS": "lots"}, "max_tokens from env MLXKV_MAX_TOKENS"),
    ({"MLXKV_MAX_TOKENS": "-3"}, "positive"),
    ({"MLXKV_DTYPE": "int4"}, "dtype"),
    ({"MLXKV_PREFIX_CACHE": "maybe"}, "boolean"),
    ({"MLXKV_RAM_CACHE_BYTES": "a lot"}, "not a size"),
])
def test_bad_values_name_the_setting_and_source(env, needle):
    with pytest.raises(SettingsError, match=needle):
        Settings.load({}, env=env)


def test_bad_config_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("max_tokens = = 3\n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        Settings.load({}, env={}, config_path=bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("max_tokenz = 3\n")
    with pytest.raises(SettingsError, match="unknown setting.*max_tokenz"):
        Settings.load({}, env={}, config_path=unknown)
    with pytest.raises(SettingsError, match="config file not found"):
        Settings.load({}, env={}, config_path=tmp_path / "missing.toml")


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 1024**3
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1e9") == 10**9
    assert parse_bytes(4096) == 4096
    with pytest.raises(SettingsError):
        parse_bytes("12 parsecs")


def test_replace_marks_override(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    s = Settings.load({}, env={}).replace(max_tokens="7")
    assert s.max_tokens == 7 and s.sources["max_tokens"] == "override"
    with pytest.raises(SettingsError):
        s.replace(nonsense=1)


def test_model_generation_config_sits_between_config_file_and_defaults(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.6, "top_p": 0.8, "top_k": 20, "eos_token_id": 2}')
    cfg = tmp_path / "c.toml"
    cfg.write_text("top_k = 7\n")
    s = Settings.load({"model": str(model), "top_p": 0.5}, env={}, config_path=cfg)
    gen = f"model {model / 'generation_config.json'}"
    assert (s.temperature, s.sources["temperature"]) == (0.6, gen)
    assert (s.top_p, s.sources["top_p"]) == (0.5, "flag --top-p")
    assert (s.top_k, s.sources["top_k"]) == (7, f"config {cfg}")
    assert (s.min_p, s.sources["min_p"]) == (0.0, "default")

    (model / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.9}')
    assert Settings.load({"model": str(model)}, env={}, config_path=cfg).temperature == 0.0
    # an unreadable recommendation is ignored; the defaults stand
    (model / "generation_config.json").write_text("{not json")
    s = Settings.load({"model": str(model)}, env={}, config_path=cfg)
    assert (s.temperature, s.sources["temperature"]) == (0.0, "default")


def test_the_typed_settings_name_exactly_the_table_and_defaults_come_from_it():
    import typing

    hints = typing.get_type_hints(Settings)
    assert set(hints) == {f.name for f in FIELDS}
    s = Settings.defaults()
    for f in FIELDS:
        assert getattr(s, f.name) == f.default and s.sources[f.name] == "default"
        if f.default is not None:  # each default is of its annotated type
            assert isinstance(f.default, typing.get_args(hints[f.name]) or hints[f.name]), f.name
    t = Settings.defaults(max_batch="3")
    assert t.max_batch == 3 and t.sources["max_batch"] == "override" and s.max_batch == 8
