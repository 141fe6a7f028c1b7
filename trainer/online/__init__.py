"""The online distillation job (OSD Algorithm 1): the loop
(:class:`specops.trainer.online.trainer.OnlineTrainer`), its config, its per-cluster state and
its draft updates."""
