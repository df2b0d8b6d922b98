"""The test harness: persistent gloo worlds that run the CLI in-process (pool, worker, reset) and the per-run cache
of shared baselines (shared). docs/tests.md describes how the suite uses them."""
