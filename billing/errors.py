"""The errors billing raises on bad input: one class per problem, each with a one-line message."""

from __future__ import annotations


class BillingError(Exception):
    """Base of every billing error; str(error) is a one-line message fit for a CLI or a 4xx body."""


class InvalidTier(BillingError):
    pass


class InvalidLimit(BillingError):
    pass


class UnknownTenant(BillingError):
    pass


class DuplicateTenant(BillingError):
    pass


class UnknownKey(BillingError):
    pass


class InvalidAdapter(BillingError):
    pass


class UnknownAdapter(BillingError):
    pass


class DuplicateAdapter(BillingError):
    pass


class UnknownGrant(BillingError):
    pass


class InvalidReport(BillingError):
    pass


class MissingPrice(BillingError):
    pass


class UnknownRequest(BillingError):
    pass
