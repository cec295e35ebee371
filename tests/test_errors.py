"""One errors module with one root (issue 21, item 5): every error a user can see is defined in
ctxreplay/errors.py and derives from CtxReplayError; the CLI maps them to exit codes in one place."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from ctxreplay import errors

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ["ctxreplay", "pipeline", "stages", "schemas"]

# internal control flow: raised and caught inside ctxreplay, never shown to a user as such
PRIVATE = {"WorkerBug", "_Remote", "NotToml", "NotARegularFile",
           "_Unexpected"}  # rgcopy: a footer it does not expect; caught there, the batch re-encoded
# the CLI's wrapper that shows a CtxReplayError (pipeline/commands/cli.py)
CLI_SHOWN = "_Shown"


def _error_classes() -> dict[str, type]:
    return {n: c for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, BaseException)}


def _defined_exceptions() -> list[tuple[str, str]]:
    """(file, class) for every class outside ctxreplay/errors.py whose bases name an exception."""
    ours = set(_error_classes())
    exceptional = ours | {"Exception", "BaseException", "ValueError", "KeyError", "TypeError", "RuntimeError",
                          "ClickException", "click.ClickException", "LookupError", "OSError"}
    found = []
    for d in PACKAGE_DIRS:
        for f in sorted((ROOT / d).rglob("*.py")):
            if f == ROOT / "ctxreplay" / "errors.py":
                continue
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    bases = {ast.unparse(b) for b in node.bases}
                    if bases & exceptional or any(b.endswith(("Error", "Exception")) for b in bases):
                        found.append((str(f.relative_to(ROOT)), node.name))
    return found


def test_every_user_facing_error_is_defined_in_the_errors_module() -> None:
    outside = [(f, c) for f, c in _defined_exceptions() if c not in PRIVATE and c != CLI_SHOWN]
    assert outside == []
    shown = [f for f, c in _defined_exceptions() if c == CLI_SHOWN]
    assert shown == ["pipeline/commands/cli.py"]


def test_one_root_and_the_docstring_lists_the_hierarchy() -> None:
    classes = _error_classes()
    assert set(classes) - {"CtxReplayError"} and all(issubclass(c, errors.CtxReplayError) for c in classes.values())
    doc = errors.__doc__ or ""
    for name, cls in classes.items():
        assert f" {name} " in doc, f"{name} is not in the hierarchy of ctxreplay/errors.py's docstring"
        assert cls.exit_code == (130 if name == "Interrupted" else 2)
    for name in PRIVATE:
        assert f"`{name}`" in doc


def test_the_old_homes_still_give_the_names_they_use() -> None:
    from ctxreplay.pipeline.inspection.threads import AmbiguousRef, UnknownRef
    from ctxreplay.pipeline.stageapi.registry import StageNameTaken, UnknownStage
    from ctxreplay.schemas.check import SchemaMismatch

    assert (AmbiguousRef, UnknownRef, StageNameTaken, UnknownStage, SchemaMismatch) == (
        errors.AmbiguousRef, errors.UnknownRef, errors.StageNameTaken, errors.UnknownStage, errors.SchemaMismatch)


def test_unknown_stage_names_the_plugin_that_failed_to_provide_it() -> None:
    e = errors.UnknownStage("redact", ["images", "snip"], ("redact-secrets", "ImportError: no module x"))
    assert str(e) == ("Unknown stage 'redact'. (the plug-in redact-secrets that provides it failed to load: "
                      "ImportError: no module x) Known stages: images, snip")
    assert isinstance(e, KeyError) and isinstance(e, errors.CtxReplayError)
