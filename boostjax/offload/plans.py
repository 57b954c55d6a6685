"""Re-export shim for `boostjax.offload.apply` until it imports `boostjax.offload.fit` / `planfile` (delete then)."""
from boostjax.offload.fit import check_planned_for  # noqa: F401
from boostjax.offload.planfile import read_plan  # noqa: F401
