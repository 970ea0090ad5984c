"""linjax."""
