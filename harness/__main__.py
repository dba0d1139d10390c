from harness.cli import entry

if __name__ == "__main__":  # not when a worker process started by spawn imports it (harness.analysis.partitioned)
    entry()
