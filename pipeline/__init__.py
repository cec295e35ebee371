"""The machinery behind the `ctxreplay` command, one subpackage per job.

From the bottom up (each imports only from those below it; `.importlinter` writes it down and CI checks
it): `core` (constants, tokens, output directories, block-table helpers), `targets` (provider wire
shapes and their validators), `stageapi` (the stage contract), `loaders` (transcripts into the blocks
table), `staging` (running a pipeline's stages, the spec, the ledger), `assembly` (each call's
request and the request store), `cost` (prices and the cache simulator), `batch` (a run over many
files: batches, workers, Ray, manifest, reuse), then the jobs: `reporting` (report, compare, HTML),
`regress` (snapshot, diff, the pytest plug-in), `inspection` (why, threads, ledger queries), `engine`
(the live engine), and `commands` (the command line)."""
