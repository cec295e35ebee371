"""A run over many files: planning batches (`batches`), one batch's load-stage-replay
(`batchrun`), the writers kept between batches (`batchout`), worker processes (`workers`) and Ray
(`rayengine`), the manifest and reuse of unchanged inputs (`manifest`, `reuse`), and the
orchestration of a whole run (`runner`)."""
