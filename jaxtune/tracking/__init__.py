"""Where a run's curves and figures go besides the store: Prefect artifacts updated as it trains
(`live`), TensorBoard event files (`tensorboard`) and an MLflow server (`mlflow_run`), and the
names the Prefect UI shows runs and artifacts under (`ui`).

Nothing here changes what a stage computes or its key: the stages and the flow hand these
writers what they already have (log records, summaries, artifact folders), and `tracking.*`
settings are in no config section a key hashes.

May import: jaxtune.config, jaxtune.errors, jaxtune.records, jaxtune.artifacts, jaxtune.host
"""
