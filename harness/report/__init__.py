"""Ways to show results: terminal tables and progress."""
