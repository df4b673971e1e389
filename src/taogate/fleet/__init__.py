"""The instances and their live state: health, breaker, leases, engine stats, and the wait queue."""
