"""The live engine: the batch replay's stages and ledger, one session at a time, as an agent runs
(`engine`); the appended-call path that needs no pipeline pass (`live`), and the engine's replay
state (`engine_replay`)."""
