"""Many runs towards one question: ``sweep`` (a grid of what-ifs), ``capacity`` (the highest
rate within SLOs) and ``fidelity`` (predictions against the published serving figures in
``published/``)."""
