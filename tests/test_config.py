from __future__ import annotations

from pathlib import Path

import pytest

from daemon.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


def test_config_toml_documents_the_defaults() -> None:
    """The shipped config.toml must state exactly the built-in defaults."""
    assert load_config(ROOT / "config.toml") == Config()


def test_speculation_is_on_unless_turned_off(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[decode]\nspeculate = "off"\n')
    assert Config().speculate == "auto" and load_config(path).speculate == "off"
    assert load_config(None, speculate="off").speculate == "off"  # kvd serve --speculate off


def test_flags_override_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('model = "builtin:tiny-swa"\n[server]\nport = 9000\n')
    config = load_config(path, port=0, data_dir=tmp_path / "d", model=None)
    assert config.model == "builtin:tiny-swa"
    assert config.port == 0
    assert config.data_dir == tmp_path / "d"


@pytest.mark.parametrize(
    "text, message",
    [
        ("nonsense = 1\n", "unknown key nonsense"),
        ("[server]\nprot = 1\n", "unknown key server.prot"),
        ("[server]\nport = 70000\n", "server.port must be 0-65535"),
        ('[server]\nport = "80"\n', "server.port must be an integer"),
        ("[generation]\ntemperature = 3\n", "generation.temperature must be in [0, 2]"),
        ("[generation]\ntop_p = 0\n", "generation.top_p must be in (0, 1]"),
        ("[limits]\nmax_text_chars = -1\n", "limits.max_text_chars must be positive"),
        ('blas = ""\n', 'blas must be "auto", "off" or the path of a BLAS library'),
        ('blas_threads = -1\n', 'blas_threads must be >= 0'),
        ('[decode]\nspeculate = "on"\n', 'decode.speculate must be "auto" or "off"'),
        ("[generation]\nmax_tokens = 5000\n", "must not exceed limits.max_tokens_limit"),
        ("model = \n", "Invalid value"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as info:
        load_config(path)
    assert message in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
