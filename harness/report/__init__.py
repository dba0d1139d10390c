"""Stage 5, showing results: terminal tables and progress, chart data, the self-contained HTML
report and PNG/SVG plots. Reads what `analysis` computed; computes no statistic of its own.
May import everything but `cli`."""
