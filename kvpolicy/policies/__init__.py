"""Policies: what each KV head keeps of a layer (or how the engine otherwise runs it), by name. No vLLM here."""

from dataclasses import fields

from kvpolicy.policies.adaheavy import AdaHeavy
from kvpolicy.policies.adamix import AdaMix
from kvpolicy.policies.base import (
    CompressedKV,
    HeadGroup,
    Inputs,
    Mode,
    ModelShape,
    ModeTraits,
    Policy,
    PromptKV,
    RelocatingPolicy,
    Schedule,
)
from kvpolicy.policies.d2o import D2O
from kvpolicy.policies.h2o import H2O
from kvpolicy.policies.keydiff import KeyDiff
from kvpolicy.policies.omnikv import OmniKV
from kvpolicy.policies.passthrough import IdentityPolicy, NoPolicy
from kvpolicy.policies.pod import PoD
from kvpolicy.policies.rkv import RKV
from kvpolicy.policies.snapkv import AdaPyramid, AdaSnapKV, PyramidKV, SnapKV
from kvpolicy.policies.streaming import StreamingLLM

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        NoPolicy,
        IdentityPolicy,
        SnapKV,
        AdaSnapKV,
        PyramidKV,
        AdaPyramid,
        AdaMix,
        AdaHeavy,
        RKV,
        StreamingLLM,
        KeyDiff,
        H2O,
        D2O,
        OmniKV,
        PoD,
    )
}


def make_policy(name: str, **options) -> Policy:
    """Instantiate a policy with the options it declares; the rest are ignored."""
    cls = POLICIES[name]
    return cls(**{f.name: options[f.name] for f in fields(cls) if f.name in options})


__all__ = [
    "POLICIES",
    "CompressedKV",
    "HeadGroup",
    "Inputs",
    "Mode",
    "ModeTraits",
    "ModelShape",
    "Policy",
    "PromptKV",
    "RelocatingPolicy",
    "Schedule",
    "make_policy",
]
