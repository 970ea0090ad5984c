"""`linjax.cli:main` and `python -m linjax.cli`, for installs and scripts made before the command
moved to linjax/app/cli.py."""
from linjax.app.cli import main

if __name__ == "__main__":
    main()
