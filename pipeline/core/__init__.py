"""Shared foundations: constants written once, token counting, plain-word counts, output-directory
handling (atomic publish, locks), block-table helpers, progress lines and crash points for tests.
Imports nothing of ctxreplay but the schemas and the errors."""
