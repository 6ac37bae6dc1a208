"""The errors billing raises on bad input: one class per problem, each with a one-line message."""

from __future__ import annotations


class BillingError(Exception):
    """Base of every billing error; str(error) is a one-line message fit for a CLI or a 4xx body."""


class NotFound(BillingError):
    """The thing named does not exist (a 404 over HTTP)."""


class AlreadyExists(BillingError):
    """The thing to create exists already (a 409 over HTTP)."""


class InvalidTier(BillingError):
    pass


class InvalidLimit(BillingError):
    pass


class UnknownTenant(NotFound):
    pass


class DuplicateTenant(AlreadyExists):
    pass


class UnknownKey(NotFound):
    pass


class InvalidAdapter(BillingError):
    pass


class UnknownAdapter(NotFound):
    pass


class DuplicateAdapter(AlreadyExists):
    pass


class UnknownGrant(NotFound):
    pass


class InvalidReport(BillingError):
    pass


class MissingPrice(BillingError):
    pass


class InvalidPrice(BillingError):
    pass


class InvalidBudget(BillingError):
    pass


class UnknownBudget(NotFound):
    pass
