"""Alembic environment and versions for billing's tables (run through billing.db.upgrade or `tiergate db upgrade`)."""
