"""redact-secrets: a ctxreplay stage that masks API keys and tokens (see stage.py)."""

from redact_secrets.stage import PATTERNS, RedactSecrets, redact_secrets

__all__ = ["PATTERNS", "RedactSecrets", "redact_secrets"]
