-- Runs once, when the postgres volume is first initialised (as POSTGRES_USER, who owns it).
-- The MLflow backend store is POSTGRES_DB; the trainer's APScheduler job store gets its own
-- database, so a schema migration of one never touches the other.
CREATE DATABASE specops_jobs;
