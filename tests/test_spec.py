import pytest

from jobs import spec_text


def test_config_as_json_or_yaml():
    assert spec_text.parse_config('{"lr": 0.1, "layers": [1, 2]}') == {"lr": 0.1, "layers": [1, 2]}
    assert spec_text.parse_config("lr: 0.1\nlayers:\n  - 1\n  - 2\n") == {"lr": 0.1, "layers": [1, 2]}
    assert spec_text.parse_config("  ") == {}


def test_unparsable_config_says_where():
    with pytest.raises(spec_text.SpecError, match=r"not valid JSON: .*line 1, column \d+"):
        spec_text.parse_config('{"lr": 0.1,,}')
    with pytest.raises(spec_text.SpecError, match=r"not valid YAML: .*line 2"):
        spec_text.parse_config("lr: 0.1\n  bad: : indent\n")


def test_config_must_be_a_mapping():
    with pytest.raises(spec_text.SpecError, match="mapping"):
        spec_text.parse_config("[1, 2]")
    with pytest.raises(spec_text.SpecError, match="mapping"):
        spec_text.parse_config("just words")


def test_args_split_like_a_shell():
    assert spec_text.parse_args("--lr 0.1 --name 'my run'") == ["--lr", "0.1", "--name", "my run"]
    with pytest.raises(spec_text.SpecError, match="cannot be split"):
        spec_text.parse_args("--name 'unclosed")


def test_env_lines():
    assert spec_text.parse_env("A=1\n# comment\n\nB = two words\n") == {"A": "1", "B": " two words"}
    with pytest.raises(spec_text.SpecError, match="line 1: expected NAME=value"):
        spec_text.parse_env("nonsense")
    with pytest.raises(spec_text.SpecError, match="not a valid variable name"):
        spec_text.parse_env("1A=x")


@pytest.mark.parametrize("name", ["E31_DATA_DIR", "PATH", "CUDA_VISIBLE_DEVICES", "SM_MODEL_DIR", "HOME"])
def test_env_cannot_override_what_the_network_sets(name):
    with pytest.raises(spec_text.SpecError, match="set by the network"):
        spec_text.parse_env(f"{name}=x")
