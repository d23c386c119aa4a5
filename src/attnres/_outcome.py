"""The one outcome shape: how a resolution ended.

It lives on its own (importing only the vocabulary and the backend registry)
so that every result can compose it without an import cycle: the trace
(``attnres.trace``, which re-exports it), the resolver's ``Resolution``, the
ledger's ``Decision`` and the plan's ``LayerPlan`` each hold one ``Outcome``
and delegate their ``status``/``origin``/``backend``/``reason``/``code``/
``error`` attributes to it rather than restating its fields.
"""

from __future__ import annotations

from attrs import field, frozen

from attnres._states import (
    Code,
    Origin,
    Reason,
    Status,
    optional_code,
    optional_reason,
    to_origin,
    to_status,
)
from attnres.backends import Backend

__all__ = ["Outcome", "OutcomeView"]


@frozen
class Outcome:
    """How a resolution ended: the one outcome shape every result composes.

    ``Resolution``, ``Decision`` and the plan's ``LayerPlan`` each hold one of
    these (their ``outcome``) rather than restating its fields.
    """

    status: Status = field(converter=to_status)
    origin: Origin = field(converter=to_origin)
    backend: Backend | None = None
    reason: Reason | None = field(default=None, converter=optional_reason)
    code: Code | None = field(default=None, converter=optional_code)
    error: str | None = None


class OutcomeView:
    """Read-through attributes for a record that holds an ``outcome``.

    The ledger's ``Decision`` and the plan's ``LayerPlan`` report the outcome's
    fields as it has them (``backend`` a :class:`~attnres.Backend`, ``None`` when
    rejected); they inherit these properties instead of writing them twice.
    """

    __slots__ = ()
    outcome: Outcome

    @property
    def status(self) -> Status:
        return self.outcome.status

    @property
    def backend(self) -> Backend | None:
        """The chosen backend (equal to its name); ``None`` when the resolution was
        rejected."""
        return self.outcome.backend

    @property
    def reason(self) -> Reason | None:
        return self.outcome.reason

    @property
    def origin(self) -> Origin:
        return self.outcome.origin

    @property
    def error(self) -> str | None:
        return self.outcome.error

    @property
    def code(self) -> Code | None:
        return self.outcome.code
