"""The whole schema's metadata: every module of billing's tables imported, so Alembic compares all of them
with the migrated database (models.py and batch_models.py each declare theirs on the one ``Base``)."""

from __future__ import annotations

from billing import batch_models, models

metadata = models.Base.metadata
__all__ = ["batch_models", "metadata"]
