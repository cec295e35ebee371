"""Arrow schemas, declared once: blocks, decisions (ledger), calls, request store, quarantine."""

from ctxreplay.schemas.blocks import BLOCKS
from ctxreplay.schemas.calls import CALLS
from ctxreplay.schemas.decisions import DECISIONS, STAGE_DECISION
from ctxreplay.schemas.messages import CALL_MESSAGES, MESSAGES
from ctxreplay.schemas.quarantine import QUARANTINE

__all__ = ["BLOCKS", "CALLS", "CALL_MESSAGES", "DECISIONS", "MESSAGES", "QUARANTINE", "STAGE_DECISION"]
