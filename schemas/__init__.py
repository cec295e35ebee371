"""Arrow schemas, declared once: blocks, decisions (ledger), calls, quarantine."""

from schemas.blocks import BLOCKS
from schemas.calls import CALLS
from schemas.decisions import DECISIONS, STAGE_DECISION
from schemas.quarantine import QUARANTINE

__all__ = ["BLOCKS", "CALLS", "DECISIONS", "STAGE_DECISION", "QUARANTINE"]
