"""``[[keys]]`` entries added to and removed from a config file as text: the rest stays as it was."""

from __future__ import annotations

import tomllib

import pytest

from taogate.tenancy.keyfile import add_key, remove_key

CONFIG = """\
# the gateway
[gateway]
port = 8080

[[keys]]
name = "a"
key_env = "A_KEY"  # team a

# the fleet
[[instances]]
url = "http://127.0.0.1:8000"
"""


def test_a_key_is_appended_with_its_hash_and_limits_only() -> None:
    out = add_key(CONFIG, "b", "f" * 64, {"requests_per_minute": 60, "models": ["m"], "weight": None})
    assert out.startswith(CONFIG.rstrip("\n"))
    keys = tomllib.loads(out)["keys"]
    assert keys[-1] == {"name": "b", "key_sha256": "f" * 64, "requests_per_minute": 60, "models": ["m"]}
    with pytest.raises(ValueError, match="already"):
        add_key(out, "a", "0" * 64, {})
    assert tomllib.loads(add_key("", "c", "0" * 64, {}))["keys"] == [{"name": "c", "key_sha256": "0" * 64}]


def test_a_key_is_removed_and_the_comments_of_the_next_table_stay() -> None:
    out = remove_key(CONFIG, "a")
    assert "A_KEY" not in out and "# the fleet" in out and "# the gateway" in out
    data = tomllib.loads(out)
    assert "keys" not in data and data["instances"] == [{"url": "http://127.0.0.1:8000"}]
    with pytest.raises(KeyError):
        remove_key(CONFIG, "nobody")
    both = add_key(CONFIG, "b", "f" * 64, {})
    assert [k["name"] for k in tomllib.loads(remove_key(both, "a"))["keys"]] == ["b"]
    assert [k["name"] for k in tomllib.loads(remove_key(both, "b"))["keys"]] == ["a"]
