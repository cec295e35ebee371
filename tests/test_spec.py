"""The pipeline spec: validated before any data is read, with place, problem and fix."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

from ctxreplay.errors import SpecError
from ctxreplay.pipeline.stageapi.registry import STAGES, StageResult, stage
from ctxreplay.pipeline.staging.spec import load_spec, parse_spec, preset_names


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SpecProbe:
    keep_recent: int = 5
    """How many to keep."""
    mode: Literal["a", "b"] = "a"
    """A choice."""
    ratio: float = 0.5
    """A float."""
    tools: tuple[str, ...] = ("*",)
    """A list."""


@pytest.fixture(autouse=True)
def _probe_stage():
    @stage("spec_probe", version=1, params=SpecProbe)
    def spec_probe(blocks, params, ledger, ctx):  # pragma: no cover - never run
        return StageResult(blocks, ledger)

    yield
    STAGES.pop("spec_probe", None)


def test_defaults_are_filled_in_and_hash_is_stable() -> None:
    a = parse_spec('[pipeline]\nname = "x"\n[[stage]]\nuse = "spec_probe"\n', source="a.toml")
    b = parse_spec('[pipeline]\nname = "x"\n[[stage]]\nuse = "spec_probe"\nkeep_recent = 5\n', source="b.toml")
    assert a.resolved()["stage"][0] == {"use": "spec_probe", "version": 1, "keep_recent": 5, "mode": "a",
                                       "ratio": 0.5, "tools": ["*"]}
    assert a.sha256 == b.sha256
    c = parse_spec('[pipeline]\nname = "x"\n[[stage]]\nuse = "spec_probe"\nkeep_recent = 6\n', source="c.toml")
    assert c.sha256 != a.sha256


def test_unknown_parameter_names_the_stage_and_suggests() -> None:
    with pytest.raises(SpecError) as e:
        parse_spec('[[stage]]\nuse = "spec_probe"\nkeep_recnt = 3\n', source="spec.toml")
    assert str(e.value).startswith("spec.toml [[stage]] #1 (spec_probe): unknown parameter 'keep_recnt'. "
                                   "Did you mean 'keep_recent'? Parameters: keep_recent, mode, ratio, tools")


def test_bad_choice_lists_the_options() -> None:
    with pytest.raises(SpecError, match=r"#1 \(spec_probe\): mode must be one of a, b; got 'c'"):
        parse_spec('[[stage]]\nuse = "spec_probe"\nmode = "c"\n', source="spec.toml")


def test_wrong_type_is_refused() -> None:
    with pytest.raises(SpecError, match="keep_recent must be int; got 'five'"):
        parse_spec('[[stage]]\nuse = "spec_probe"\nkeep_recent = "five"\n', source="spec.toml")
    with pytest.raises(SpecError, match="keep_recent must be int; got True"):
        parse_spec('[[stage]]\nuse = "spec_probe"\nkeep_recent = true\n', source="spec.toml")


def test_unknown_stage_did_you_mean() -> None:
    with pytest.raises(SpecError, match=r"spec.toml \[\[stage\]\] #2: Unknown stage 'spec_prob'. Did you mean 'spec_probe'\?"):
        parse_spec('[[stage]]\nuse = "spec_probe"\n[[stage]]\nuse = "spec_prob"\n', source="spec.toml")


def test_invalid_toml_names_line_and_column() -> None:
    with pytest.raises(SpecError, match=r"spec.toml: not valid TOML: .*line 2"):
        parse_spec('[[stage]]\nuse "x"\n', source="spec.toml")


def test_stage_table_must_be_an_array() -> None:
    with pytest.raises(SpecError, match=r"write \[\[stage\]\], not \[stage\]"):
        parse_spec('[stage]\nuse = "x"\n', source="spec.toml")


def test_missing_use_and_unknown_pipeline_key() -> None:
    with pytest.raises(SpecError, match="missing 'use'"):
        parse_spec('[[stage]]\nkeep_recent = 1\n', source="spec.toml")
    with pytest.raises(SpecError, match="unknown key 'nam'. Did you mean 'name'"):
        parse_spec('[pipeline]\nnam = "x"\n', source="spec.toml")


def test_presets_load_and_unknown_preset_suggests() -> None:
    assert {"identity", "default"} <= set(preset_names())
    for name in preset_names():
        assert load_spec(preset=name).name
    assert load_spec(preset="identity").stages == ()
    with pytest.raises(SpecError, match="unknown preset 'identiy'. Did you mean 'identity'"):
        load_spec(preset="identiy")


def test_missing_spec_file(tmp_path) -> None:
    with pytest.raises(SpecError, match="pipeline spec not found"):
        load_spec(tmp_path / "nope.toml")
