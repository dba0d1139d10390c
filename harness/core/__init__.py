"""The ground floor every other package stands on: the harness's error types, secret redaction,
GPU name matching, the CPUs a job may use and the logging callable. Holds no pipeline stage and
imports nothing of the harness."""
