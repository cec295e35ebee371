"""ctxreplay: replay what an agent sent to its model, call by call, from transcripts on disk."""

__version__ = "0.1.0"
