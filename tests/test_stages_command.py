"""`ctxreplay stages`: owner and version of every stage, its needs, and its defaults as a [[stage]]
table that pastes into a spec as it is (issues 9 and 13)."""

from __future__ import annotations

import json
import tomllib

from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main as cli
from ctxreplay.pipeline.stageapi.registry import load_stages
from ctxreplay.pipeline.staging.spec import ResolvedStage, parse_spec


def test_json_is_one_object_with_named_keys() -> None:
    r = CliRunner().invoke(cli, ["stages", "--json"])
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert set(doc) == {"stages", "plugin_errors"}
    by_name = {s["name"]: s for s in doc["stages"]}
    assert set(by_name) >= {"sanitize", "inter_session", "images", "pairing", "result_budget", "snip", "tombstone"}
    snip = by_name["snip"]
    assert (snip["owner"], snip["builtin"], snip["requires"], snip["reads"]) == ("ctxreplay", True, ["pairing"],
                                                                                 ["tombstone"])
    assert snip["owner_version"] and snip["doc"].startswith("Remove whole old middle turns")
    assert {p["name"] for p in snip["params"]} >= {"high_watermark", "low_watermark"}


def test_every_defaults_block_pastes_into_a_spec_and_gives_the_defaults() -> None:
    r = CliRunner().invoke(cli, ["stages", "--json"])
    for s in json.loads(r.stdout)["stages"]:
        if not s["builtin"]:
            continue
        block = s["toml"]
        assert tomllib.loads(block)["stage"][0]["use"] == s["name"]
        needs = "".join(f'[[stage]]\nuse = "{n}"\n' for n in ("sanitize", "pairing") if n in s["requires"] or
                        (n == "sanitize" and "pairing" in s["requires"]))
        spec = parse_spec(f"{needs}{block}\n", source="pasted.toml")
        st = load_stages()[s["name"]]
        # the same resolved params as the defaults: the same config digest, the same ledger namespace
        assert spec.stages[-1].config_digest == ResolvedStage(st, st.params()).config_digest, s["name"]


def test_human_output_names_owner_and_prints_the_blocks() -> None:
    r = CliRunner().invoke(cli, ["stages"])
    assert r.exit_code == 0
    assert "# tombstone v1, from ctxreplay " in r.stdout and "(built-in)" in r.stdout
    assert '[[stage]]\nuse = "tombstone"\ntrigger_tokens = 100000  # Fire when' in r.stdout
    assert 'tools = { allow = ["*"], deny = [] }' in r.stdout
