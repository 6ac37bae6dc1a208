"""Billing errors become admin HTTP errors by their kind: not found 404, already exists 409, else 400."""

from __future__ import annotations

import pytest

from billing import errors
from gateway.admin import billing_error


def _all_billing_errors() -> list[type[errors.BillingError]]:
    found, todo = [], [errors.BillingError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if c not in (errors.BillingError, errors.NotFound, errors.AlreadyExists)]


@pytest.mark.parametrize("error_class", _all_billing_errors(), ids=lambda c: c.__name__)
def test_each_billing_error_maps_to_the_status_of_its_kind(error_class):
    expected = 404 if issubclass(error_class, errors.NotFound) else 409 if issubclass(error_class, errors.AlreadyExists) else 400
    assert billing_error(error_class("x")).status == expected


def test_unknown_and_duplicate_errors_are_of_the_not_found_and_exists_kinds():
    assert issubclass(errors.UnknownTenant, errors.NotFound) and issubclass(errors.UnknownGrant, errors.NotFound)
    assert issubclass(errors.DuplicateTenant, errors.AlreadyExists)
    assert not issubclass(errors.InvalidTier, (errors.NotFound, errors.AlreadyExists))
