"""The application: the `linjax` command (`cli`), `linjax run` (`pipeline`), `linjax eval` (`eval_cli`),
`linjax bench latency` (`latency_cli`), their argparse types (`arguments`), the huge-page re-exec
(`hugepages`) and the watchdog thread (`watchdog`). It imports the core and the tasks (convert,
train, eval); nothing below imports it (tests/test_layering.py)."""
