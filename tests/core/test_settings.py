"""The one settings loader (``core/settings.py``): defaults < TOML file < environment < overrides, a table or
the top level, variable aliases, and errors that name each bad field with where its value came from."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from specops.core import settings


class Demo(settings.ExplicitSettings):
    model_config = SettingsConfigDict(extra="forbid", env_prefix="DEMO_", enable_decoding=False)

    port: int = Field(8000, ge=1, description="a port")
    mode: Literal["a", "b"] = Field("a", description="a choice")
    name: str = Field("x", description="a name")
    api_key: str = Field("", pattern="^(|.{8,})$", description="a secret")


def test_precedence_and_where_values_come_from(tmp_path, monkeypatch):
    path = tmp_path / "demo.toml"
    path.write_text('port = 1\nmode = "b"\nname = "file"\n')
    env = {"DEMO_PORT": "2", "DEMO_NAME": "env"}
    assert settings.load(Demo, env={}) == Demo()
    assert settings.load(Demo, path=path, env={}) == Demo(port=1, mode="b", name="file")
    assert settings.load(Demo, path=path, env=env) == Demo(port=2, mode="b", name="env")
    got = settings.load(Demo, path=path, env=env, overrides={"port": 3, "name": None})
    assert got == Demo(port=3, mode="b", name="env")  # None: not given
    monkeypatch.setenv("DEMO_PORT", "4")
    assert Demo().port == 8000  # plain construction reads no environment
    assert settings.load(Demo).port == 4  # load reads os.environ unless given env


def test_a_table_or_the_top_level_and_aliases(tmp_path):
    path = tmp_path / "demo.toml"
    path.write_text("[demo]\nport = 5\n[other]\nport = 6\n")
    assert settings.load(Demo, path=path, table="demo", env={}).port == 5
    aliased = {"OLD_NAME": "old", "DEMO_PORT": "7"}
    assert settings.load(Demo, env=aliased, env_aliases={"OLD_NAME": "DEMO_NAME"}).name == "old"
    both = {"OLD_NAME": "old", "DEMO_NAME": "own"}
    assert settings.load(Demo, env=both, env_aliases={"OLD_NAME": "DEMO_NAME"}).name == "own"  # its own wins


@pytest.mark.parametrize(
    ("toml", "env", "overrides", "message"),
    [
        ("prot = 1\n", {}, {}, "invalid demo: prot (in {path}): unknown key: not a demo key"),
        ("port = 0\n", {}, {}, "port (in {path}): Input should be greater than or equal to 1"),
        ("", {"DEMO_PORT": "lots"}, {}, "port (DEMO_PORT='lots'): Input should be a valid integer"),
        ("", {}, {"mode": "c"}, "mode (--mode): Input should be 'a' or 'b'"),
        ("port = \n", {}, {}, "cannot read demo {path}"),
    ],
)
def test_errors_name_the_field_and_its_source(tmp_path, toml, env, overrides, message):
    path = tmp_path / "demo.toml"
    path.write_text(toml)
    with pytest.raises(ValueError) as err:
        settings.load(Demo, path=path, env=env, overrides=overrides, what="demo", unknown="not a demo key")
    assert message.format(path=path) in str(err.value)


def test_a_secret_is_named_not_shown():
    with pytest.raises(ValueError) as err:
        settings.load(Demo, env={"OLD_KEY": "short"}, env_aliases={"OLD_KEY": "DEMO_API_KEY"})
    assert "api_key (OLD_KEY): String should match pattern" in str(err.value) and "short" not in str(err.value)


def test_an_unreadable_file_is_named(tmp_path):
    missing = tmp_path / "missing.toml"
    with pytest.raises(ValueError, match="cannot read demo .*missing.toml"):
        settings.load(Demo, path=missing, env={}, what="demo")
