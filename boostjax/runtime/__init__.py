"""The processes and devices a run uses: simulated CPU devices (`devices`), multi-host process groups
(`multihost`), the scheduler variables they are read from (`schedulers`) and their local launcher
(`launch`), signals turned into a clean stop (`interrupt`), and named hardware profiles (`hardware`)."""
