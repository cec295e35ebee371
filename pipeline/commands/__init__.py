"""The `ctxreplay` command line: the click group and the run / inspection commands (`cli`), the
regression commands (`cli_regress`), the cost commands (`cli_report`), and what they share
(`clicommon`)."""
