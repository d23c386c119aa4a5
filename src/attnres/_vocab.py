"""The small closed vocabularies every other module speaks: roles, requirement
names, platform kinds and dtype names.

Nothing here imports torch: a ``torch.dtype`` is recognised by its string form
(``"torch.bfloat16"``), so the resolver stays importable without loading torch.
"""

from __future__ import annotations

import enum
import re
from typing import Any

from attnres.errors import InvalidArgumentError

__all__ = [
    "DTYPES",
    "MASK_KIND_PHRASES",
    "PLATFORM_KINDS",
    "REQUIREMENT_PHRASES",
    "CausalAlignment",
    "MaskKind",
    "MaskRoute",
    "Requirement",
    "Role",
    "normalize_component",
    "normalize_dtype",
    "release",
]


class _Named(str, enum.Enum):
    """A closed vocabulary whose members print as their values."""

    _value_: str

    def __str__(self) -> str:
        return self.value


class Role(_Named):
    """Whether a layer attends to its own sequence or to another one."""

    SELF = "self"
    CROSS = "cross"

    @classmethod
    def parse(cls, value: Role | str) -> Role:
        if isinstance(value, Role):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        raise InvalidArgumentError(f"role must be 'self' or 'cross', got {value!r}")


class Requirement(_Named):
    """A semantic feature a layer needs from its kernel."""

    CAUSAL = "causal"
    ATTN_MASK = "attn_mask"
    PACKED_VARLEN = "packed_varlen"
    GQA = "gqa"
    DROPOUT = "dropout"
    #: gradients flow through the kernel (a training forward)
    BACKWARD = "backward"
    #: a softmax scale other than 1/sqrt(head_size)
    CUSTOM_SCALE = "custom_scale"
    #: logit softcapping: scores -> softcap * tanh(scores / softcap)
    SOFTCAP = "softcap"
    #: local attention: query i sees keys i - left .. i + right
    SLIDING_WINDOW = "sliding_window"
    #: issue 19: attention sinks: a learned logit per head that every query's
    #: softmax also normalises over (GPT-OSS's ``sinks``, passed as ``s_aux``)
    SINKS = "sinks"
    #: issue 19: the call returns the attention weights (``torch.nn.MultiheadAttention``
    #: with ``need_weights=True``): the softmax matrix itself, which no fused kernel
    #: materialises
    WEIGHTS = "weights"


#: How an error message names a requirement ("does not implement <phrase>").
REQUIREMENT_PHRASES: dict[Requirement, str] = {
    Requirement.CAUSAL: "causal attention",
    Requirement.ATTN_MASK: "attention masks",
    Requirement.PACKED_VARLEN: "packed varlen attention",
    Requirement.GQA: "grouped-query attention",
    Requirement.DROPOUT: "attention dropout",
    Requirement.BACKWARD: "the backward pass",
    Requirement.CUSTOM_SCALE: "a custom softmax scale",
    Requirement.SOFTCAP: "logit softcapping",
    Requirement.SLIDING_WINDOW: "sliding-window attention",
    Requirement.SINKS: "attention sinks",
    Requirement.WEIGHTS: "returning the attention weights",
}


class MaskKind(_Named):
    """What a layer's attention-mask tensor says (issue 22; docs/masks.md).

    The kernel's causal flag is separate (``Requirements.causal``): "causal with
    key padding" is ``causal=True`` with ``KEY_PADDING``, named by
    :attr:`attnres.layer.Requirements.mask_kind`.
    """

    #: no mask tensor
    NONE = "none"
    #: per batch row, which key positions are valid: a boolean or 0/-inf mask of
    #: shape (batch, seq_kv) or broadcastable to (batch, 1, 1, seq_kv)
    KEY_PADDING = "key_padding"
    #: a boolean mask over arbitrary (query, key) positions
    BOOLEAN = "boolean"
    #: a float bias added to the scores (T5's position bias, ALiBi)
    ADDITIVE = "additive"
    #: 0.2's ``attn_mask=True``: an arbitrary boolean or additive mask
    ANY = "any"


#: How a failure names a mask kind ("does not take <phrase>").
MASK_KIND_PHRASES: dict[MaskKind, str] = {
    MaskKind.NONE: "no mask",
    MaskKind.KEY_PADDING: "key-padding masks",
    MaskKind.BOOLEAN: "boolean masks",
    MaskKind.ADDITIVE: "additive masks",
    MaskKind.ANY: "boolean or additive masks",
}


class MaskRoute(_Named):
    """How a kernel takes a mask kind: as a mask argument, or by unpadding."""

    #: the kernel takes the mask (or its equivalent) as an argument
    NATIVE = "native"
    #: attnres unpads the batch, runs the kernel's varlen entry point on the
    #: packed tokens (``cu_seqlens``), and pads the output back (attnres._varlen)
    UNPAD = "unpad"


class CausalAlignment(_Named):
    """Where a causal mask's diagonal sits when query and key lengths differ."""

    #: torch SDPA's ``is_causal``: query i sees keys 0..i
    TOP_LEFT = "top_left"
    #: flash-attn's ``causal``: query i sees keys 0..i + (seq_kv - seq_q)
    BOTTOM_RIGHT = "bottom_right"


#: Device kinds, in the order the docs list them.
PLATFORM_KINDS: tuple[str, ...] = ("cpu", "cuda", "rocm", "mps", "xpu", "npu")

#: Canonical dtype names (torch's own spelling) and the aliases users type.
DTYPES: tuple[str, ...] = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
)
_DTYPE_ALIASES: dict[str, str] = {
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "fp64": "float64",
    "double": "float64",
    "f64": "float64",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
_DTYPE_LOOKUP: dict[str, str] = {**{d: d for d in DTYPES}, **_DTYPE_ALIASES}


def normalize_dtype(value: Any) -> str:
    """Map ``"bf16"``, ``"bfloat16"`` or ``torch.bfloat16`` to ``"bfloat16"``."""
    if type(value) is str:
        known = _DTYPE_LOOKUP.get(value)
        if known is not None:
            return known
    text = value if isinstance(value, str) else str(value)
    key = text.strip().lower()
    key = key.removeprefix("torch.")
    try:
        return _DTYPE_LOOKUP[key]
    except KeyError:
        valid = ", ".join(DTYPES)
        raise InvalidArgumentError(
            f"dtype: unknown dtype {value!r}; use one of {valid} "
            f"(or an alias such as bf16, fp16, fp32, or a torch.dtype)"
        ) from None


_COMPONENT_SEPARATORS = re.compile(r"[\s\-]+")


def normalize_component(name: str) -> str:
    """The canonical spelling of a component name: ``Text-Encoder`` -> ``text_encoder``.

    Lower case, surrounding blanks dropped, and runs of ``-`` or blanks turned
    into one ``_``; every place that takes a component name (scopes, the
    per-component flag, the config) uses it, so the spellings cannot disagree.
    """
    return _COMPONENT_SEPARATORS.sub("_", name.strip().lower())


def release(version: str) -> tuple[int, ...]:
    """The numeric release a version string starts with (``"4.0.0b36"`` -> ``(4, 0,
    0)``, ``"v0.5.23.post1"`` -> ``(0, 5, 23)``; ``()`` for one that does not start
    with a number, such as ``"simulated"``): how every version attnres compares is read."""
    found = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    return tuple(int(p) for p in found.group(1).split(".")) if found else ()
