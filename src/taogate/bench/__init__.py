"""The article's verification as a tool: load generator, reports, comparisons and the bisection.

Modules, one concept each: ``workloads`` (what to send), ``runner`` (send it, streaming, one sample per
request), ``report`` (pure math on samples), ``render`` (tables, JSON, plot), ``scenarios`` (the
configurations compared, stood up on loopback), ``compare`` (table 4.3 in one run), ``diagnose`` (the
bisection and its verdict), ``demo`` and ``cli`` (the commands).
"""
