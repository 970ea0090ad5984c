"""The experiments behind results/: scripts that train, evaluate and report on linjax, apart from the library.

Each script runs from the repository root (`python experiments/claims.py report`); its tests are in
experiments/tests/ (`python -m pytest -q experiments/tests`), outside the library's default test run.
"""
