"""Govern Hugging Face pipelines: diffusers pipelines and transformers models.

``attnres.integrations.diffusers`` and ``attnres.integrations.transformers``
describe every attention site of a pipeline's components as a
:class:`~attnres.LayerSpec`, resolve each inside its component's
:func:`~attnres.component_scope`, and install the decisions on the routes that
execute them (a diffusers processor's pinned dispatcher backend, a transformers
model's attention implementation). See ``docs/integrations.md``.

This package imports neither diffusers nor transformers (nor torch): only its
``diffusers`` and ``transformers`` modules do, when they are imported.
"""

from attnres.integrations._folder import plan_folder
from attnres.integrations._plan import (
    DtypeChoice,
    IntegrationError,
    Problem,
    Site,
)
from attnres.integrations._untrusted import FolderBuildError

__all__ = [
    "DtypeChoice",
    "FolderBuildError",
    "IntegrationError",
    "Problem",
    "Site",
    "plan_folder",
]
