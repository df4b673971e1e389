"""Verifying a fleet as a tool: load generator, reports, side-by-side comparisons and the diagnosis.

Modules, one concept each: ``workloads`` (what to send), ``runner`` (send it, streaming, one sample per
request), ``report`` (pure math on samples), ``render`` (tables, JSON, plot), ``scenarios`` (the
configurations compared, stood up on loopback), ``compare`` (all of them side by side in one run),
``diagnose`` (the queue-cap bisection and its verdict), ``isolated`` and ``procs`` (servers in
processes of their own), ``demo`` and ``cli`` (the commands).
"""
