"""The base of every section of the cluster spec (`cluster.spec`, `cluster.spec_access`)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    # strict: no bool for an int, no string for a number (YAML reads 1e40 as a string)
    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)
