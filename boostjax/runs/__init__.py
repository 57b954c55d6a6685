"""Run folders and what is in them: the folder itself (`folder`: config.json, metrics.jsonl, the
resume policy of each field, ownership checks), checksummed Orbax checkpoints (`checkpoint`), restoring a
checkpoint into another layout (`relayout`), and reading a finished run back (`load`: `load_run`)."""
