"""The torch-free bottom layer both packages import: the job's config schema and loader, the ladder
as a table, the run-dir contract, units, logging, hardware tables and file helpers. Nothing here
imports torch, transformers or deepspeed (tests/test_architecture.py holds it)."""
