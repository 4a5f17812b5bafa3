"""``--include``/``--exclude`` (and a KServe URI's ``?include=``/``?exclude=``) are input someone
else may write: a pod spec, an InferenceService. Their number and length are bounded wherever they
enter (pack, pull, the initializer), so matching them against every file stays cheap, and they
mean the same thing everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from modelpack.cli import main
from modelpack.errors import InvalidReferenceError
from modelpack.file_selection import MAX_PATTERN_CHARS, MAX_PATTERNS, file_selector
from modelpack.serving.kserve.uri import parse_storage_uri

REF = "modelpack://127.0.0.1:5000/m/llama@sha256:" + "0" * 64


def test_a_storage_uri_with_too_many_or_too_long_patterns_is_refused() -> None:
    many = "&".join(f"include=f{i}*" for i in range(MAX_PATTERNS + 1))
    with pytest.raises(InvalidReferenceError, match="patterns"):
        parse_storage_uri(f"{REF}?{many}")
    with pytest.raises(InvalidReferenceError, match="characters"):
        parse_storage_uri(f"{REF}?exclude={'*a' * MAX_PATTERN_CHARS}")
    ok = parse_storage_uri(f"{REF}?include=*.safetensors&exclude=*.bin")
    assert ok.include == ("*.safetensors",) and ok.exclude == ("*.bin",)


@pytest.mark.parametrize("command", ["pack", "pull"])
def test_the_cli_refuses_unbounded_patterns_as_a_usage_error(
    command: str, checkpoint: Path, tmp_path: Path
) -> None:
    args = (
        ["pack", str(checkpoint), f"oci:{tmp_path / 'l'}:v1"]
        if command == "pack"
        else ["pull", f"oci:{tmp_path / 'none'}:v1", str(tmp_path / "out")]
    )
    flood = [a for i in range(MAX_PATTERNS + 1) for a in ("--include", f"f{i}*")]
    res = CliRunner().invoke(main, [*args, *flood])
    assert res.exit_code == 2 and "--include" in res.output, res.output
    long = CliRunner().invoke(main, [*args, "--exclude", "*a" * MAX_PATTERN_CHARS])
    assert long.exit_code == 2 and "--exclude" in long.output, long.output
    assert not (tmp_path / "out").exists()


def test_one_meaning_of_a_pattern_a_path_or_its_base_name() -> None:
    select = file_selector(["*.safetensors", "tokenizer*"], ["sub/*"])
    assert select is not None
    assert select("model.safetensors") and select("deep/x.safetensors") and select("tokenizer.json")
    assert not select("sub/model.safetensors") and not select("config.json")
    assert file_selector([], []) is None
