"""`python -m ctxreplay`: the same command line as `ctxreplay` (a quiet Ctrl-C at start-up first:
ctxreplay/entry.py)."""

from ctxreplay.entry import main

if __name__ == "__main__":
    main()
