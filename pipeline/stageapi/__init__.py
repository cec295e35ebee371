"""The stage contract: the `@stage` decorator and registry (`registry`), the block-edit API every
stage uses to record what it replaced (`marks`), and per-call helpers (`calls`). Plug-ins reach it
through the `ctxreplay` package's stable API."""
