"""Arrow schemas, declared once: blocks, decisions (ledger), calls, request store, quarantine."""

from schemas.blocks import BLOCKS
from schemas.calls import CALLS
from schemas.decisions import DECISIONS, STAGE_DECISION
from schemas.messages import CALL_MESSAGES, MESSAGES
from schemas.quarantine import QUARANTINE

__all__ = ["BLOCKS", "CALLS", "CALL_MESSAGES", "DECISIONS", "MESSAGES", "QUARANTINE", "STAGE_DECISION"]
