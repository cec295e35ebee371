"""`python -m ctxreplay`: the same command line as `ctxreplay`."""

from ctxreplay.pipeline.commands.cli import main

main()
