"""Running a pipeline's stages: the declarative spec and presets (`spec`, `spec_init`), one pass of
the stages over a batch with the ledger's view (`stagerun`), plug-in isolation in worker
processes (`isolation`), and the persisted DuckDB ledger of every decision (`ledger`)."""
