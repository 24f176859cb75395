"""HTML comparison reports from the suite's benchmark JSON: ``python -m reports RESULTS.json -o report.html``."""
