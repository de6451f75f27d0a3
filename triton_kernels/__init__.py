"""Triton kernels of kvpolicy over paged KV caches in any PageGeometry, each beside its plain-torch reference."""

from .geometry import PageGeometry, flat
from .keydiff_scores import keydiff_scores, keydiff_scores_reference
from .launch import STEADY_KERNELS, specialization
from .new_token_weights import new_token_weights, new_token_weights_reference
from .page_scores import (
    context_attention,
    context_attention_reference,
    context_page_scores,
    context_page_scores_reference,
    context_token_scores,
    context_token_scores_reference,
)
from .paged_attention import (
    MIN_SPLIT_KEYS,
    TARGET_PROGRAMS,
    decode_workspace,
    paged_attention,
    paged_attention_reference,
)
from .pod_attention import pod_attention, pod_attention_reference, shared_attention_reference
from .relocate import (
    gather_tokens,
    gather_tokens_reference,
    gather_values,
    gather_values_reference,
    move_tokens,
    move_tokens_reference,
    scatter_tokens,
    scatter_tokens_reference,
)
from .window_scores import window_attention_sums, window_scores, window_scores_reference
from .write_slots import write_slots, write_slots_reference

__all__ = [
    "MIN_SPLIT_KEYS",
    "PageGeometry",
    "STEADY_KERNELS",
    "TARGET_PROGRAMS",
    "context_attention",
    "context_attention_reference",
    "context_page_scores",
    "context_page_scores_reference",
    "context_token_scores",
    "context_token_scores_reference",
    "decode_workspace",
    "flat",
    "gather_tokens",
    "gather_tokens_reference",
    "gather_values",
    "gather_values_reference",
    "keydiff_scores",
    "keydiff_scores_reference",
    "move_tokens",
    "move_tokens_reference",
    "new_token_weights",
    "new_token_weights_reference",
    "paged_attention",
    "paged_attention_reference",
    "pod_attention",
    "pod_attention_reference",
    "scatter_tokens",
    "scatter_tokens_reference",
    "shared_attention_reference",
    "specialization",
    "window_attention_sums",
    "window_scores",
    "window_scores_reference",
    "write_slots",
    "write_slots_reference",
]
