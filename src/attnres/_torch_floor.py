"""The oldest torch attnres runs on: :data:`MIN_TORCH`, checked when attnres is imported.

pyproject.toml declares the same floor (``torch>=2.6``; a test keeps the two
equal) and ``make test-floor`` runs the suite on that release. Below it attnres
is not tested and parts of it cannot work (diffusers 0.42 does not import on
torch 2.5, transformers 5 disables itself there, and flex_attention's mask
creation, ``torch.compile`` and ``P2POp(group_peer=...)`` behave differently),
so an older torch -- installed with ``--no-deps``, say -- is refused at
``import attnres`` with :class:`~attnres.errors.UnsupportedVersionError`
naming the torch found and the one required, rather than half-working.

``import attnres`` does not import torch (the resolver and the command line
stay fast), so the version is read from torch's installed metadata, or from
``torch.__version__`` when torch is already imported. Where neither is there
(no torch at all), nothing is refused here: what needs torch says so itself.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from typing import Final

from attnres._vocab import release
from attnres.errors import UnsupportedVersionError

__all__ = ["MIN_TORCH", "check_torch", "installed_torch"]

#: The oldest torch release attnres supports and is tested on (``make test-floor``).
MIN_TORCH: Final = (2, 6)


def installed_torch() -> str | None:
    """The torch version present (``torch.__version__`` if imported, else the
    installed distribution's), or ``None`` when no torch is installed."""
    module = sys.modules.get("torch")
    version = getattr(module, "__version__", None) if module is not None else None
    if version is not None:
        return str(version)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def check_torch(version: str | None = None) -> None:
    """Refuse (:class:`~attnres.errors.UnsupportedVersionError`) a torch older than
    :data:`MIN_TORCH`; ``version`` defaults to :func:`installed_torch`. A version
    string that does not start with ``MAJOR.MINOR`` is left alone."""
    found = installed_torch() if version is None else version
    numbers = release(found or "")
    if len(numbers) < 2 or numbers[:2] >= MIN_TORCH:
        return
    supported = f">={MIN_TORCH[0]}.{MIN_TORCH[1]}"
    raise UnsupportedVersionError(
        f"attnres needs torch{supported} (the oldest torch it is tested on), but torch "
        f"{found} is installed. Install a supported torch: pip install 'torch{supported}'",
        "torch",
        str(found),
        supported,
    )


check_torch()
