"""Training: bootstrap models now; online distillation, datastore builds and scheduling later."""
