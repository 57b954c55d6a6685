"""The auto planner (`boostjax plan --auto`, `boostjax.plan_auto`): the whole configuration of a run on a
cluster (mesh, TP strategy, micro-batching, pipeline schedule, remat, ZeRO), from compiled programs and a
roofline time model. Modules: `cluster` (--cluster), `costs` (seconds from HLO), `cpu` (the calibrated
CPU profile), `space` (candidates, bounds, command lines), `measure` (compiled measurements, cached),
`predict` (step time and memory of a candidate), `search` (`plan_auto`), `report` (table, JSON)."""
