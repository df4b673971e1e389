"""What the gateway tells its operators: metrics, the access log, the side-by-side status."""
