"""The `offloadpp` command line: one module per command (main.py dispatches), the benchmarks in
offloadpp/bench/. Product code never imports this package."""
