"""MLflow-backed registry of drafts and datastores. Not built yet."""
