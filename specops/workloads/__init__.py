"""Production-shaped prompts for the demo, the benchmarks and the bootstrap's distillation
corpus: chat traffic by domain (:mod:`specops.workloads.chat_workload`), prompt sets
(:mod:`specops.workloads.prompts`) and the demo's phased workload. Nothing in serving imports it."""
