"""Per-(request, layer, kv-head) pages over vLLM blocks. Torch and numpy only; no vLLM, no policy."""

from kvpolicy.paging.layout import PageLayout
from kvpolicy.paging.offload import HostPagePool, OffloadedRequest, OffloadPlan, PageCopies, SparseCall, offload_blocks
from kvpolicy.paging.page_store import PageStore, virtual_tokens
from kvpolicy.paging.page_table import (
    RequestPages,
    TokenMoves,
    relocation_blocks,
    stock_page_tables,
    stock_slots,
    write_order,
)
from kvpolicy.paging.shared import (
    DecodeTables,
    DistantLogitRows,
    LayerTables,
    SharedLayoutPlan,
    SharedPages,
    ValuePairs,
    layout_blocks,
)

__all__ = [
    "DecodeTables",
    "LayerTables",
    "DistantLogitRows",
    "HostPagePool",
    "OffloadPlan",
    "OffloadedRequest",
    "PageCopies",
    "PageLayout",
    "PageStore",
    "RequestPages",
    "SharedLayoutPlan",
    "SharedPages",
    "SparseCall",
    "TokenMoves",
    "ValuePairs",
    "relocation_blocks",
    "layout_blocks",
    "offload_blocks",
    "stock_page_tables",
    "stock_slots",
    "virtual_tokens",
    "write_order",
]
