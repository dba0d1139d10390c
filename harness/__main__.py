from harness.cli import entry

entry()
