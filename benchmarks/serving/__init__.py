"""The serving benchmark's parts: workloads (what to send), the HTTP client (how to send
it and time it), metrics (what the timings mean) and the report (table and plot).
`benchmarks/bench_serving.py` is the command line that ties them together."""
