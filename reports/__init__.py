"""Self-contained plotly HTML reports read from run directories: cross-validation and policy comparison."""
